"""hvd-compress: 8-bit and 16-bit gradient compression for Horovod (PyTorch)."""
from setuptools import find_packages, setup

setup(
    name="hvd_compress",
    version="0.1.0",
    description="Bit-exact float8/float16 gradient compression for Horovod with PyTorch",
    packages=find_packages(include=["hvd_compress", "hvd_compress.*", "labs", "labs.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "torch"],
    # Horovod is deliberately not listed: it must be built against the installed torch
    # (scripts/setup.sh does that, with patches/), and pip would otherwise try to build
    # an unpatched sdist that fails against torch >= 2.1.
)
