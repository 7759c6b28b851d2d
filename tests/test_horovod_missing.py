"""hvd_compress on a Python without Horovod: what needs Horovod (the Horovod front and every
communicator made without engine=) raises HorovodMissing, which says how to get Horovod and what
runs without it; `import hvd_compress` and the codecs do not need it (the DDP hook's own run
without Horovod is tests/test_ddp.py::test_the_hook_needs_no_horovod)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# Horovod refused as an absent package is: a finder ahead of every other one raises what the
# import system raises for a module it cannot find. The script prints one line per front door.
WITHOUT_HOROVOD = r"""
import sys


class NoHorovod:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "horovod":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoHorovod)
import torch
import hvd_compress as hc
from hvd_compress.codecs import int8

model = torch.nn.Linear(3, 2)
doors = {
    "DistributedOptimizer": lambda: hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression=hc.Compression.bit8),
    "make_communicator": lambda: hc.make_communicator(hc.Compression.bit8),
}
for door, call in doors.items():
    try:
        call()
    except hc.HorovodMissing as err:
        kind = "ModuleNotFoundError" if isinstance(err, ModuleNotFoundError) else "other"
        print(f"{door}|{kind}|{err.name}|{err}")
    else:
        print(f"{door}|no error")
print("loaded|" + ",".join(sorted(m for m in sys.modules if m.split(".")[0] == "horovod")))
print("fp16|" + str(hc.Compression.fp16.compress(torch.ones(4))[0].dtype))
"""


def run_without_horovod():
    done = subprocess.run([sys.executable, "-c", WITHOUT_HOROVOD], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(line.split("|", 1) for line in done.stdout.splitlines())


@pytest.mark.interpreter
def test_what_needs_horovod_says_how_to_get_it():
    said = run_without_horovod()
    for door in ("DistributedOptimizer", "make_communicator"):
        kind, name, message = said[door].split("|", 2)
        assert kind == "ModuleNotFoundError" and name == "horovod", said[door]
        assert message.startswith("hvd_compress.DistributedOptimizer"), message
        for hint in ("bash scripts/setup.sh", "Horovod 0.28.1", "C++17", "docs/setup.md",
                     "hvd_compress.ddp", "only torch"):
            assert hint in message, (hint, message)
    # nothing of Horovod got half-imported, and what needs no Horovod still works
    assert said["loaded"] == "", said["loaded"]
    assert said["fp16"] == "torch.float16"


def test_a_missing_horovod_is_an_import_error_by_name():
    """Code that already catches ImportError or ModuleNotFoundError still catches it, and it
    can be caught by name where Horovod is installed (it lives outside engine/horovod.py)."""
    import hvd_compress as hc
    from hvd_compress.engine.base import HorovodMissing
    assert hc.HorovodMissing is HorovodMissing
    assert issubclass(HorovodMissing, ModuleNotFoundError)
    err = HorovodMissing()
    assert err.name == "horovod" and "scripts/setup.sh" in str(err)
