"""labs.kit.download against a mirror on 127.0.0.1 (tests/mirror.py) serving IDX files made
here, with their sums passed in: a whole download, a connection dropped half-way, a wrong MD5, a
disk that refuses the file, several processes at once; never a file left under its final name
that is not whole and verified."""
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT
from labs.kit import download
from mirror import Mirror, idx_gz, md5, refused_url

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(0)
# Two IDX files as MNIST's are made: 200 random 28x28 images (big enough for a progress line
# at each quarter of 64 KiB chunks) and their labels.
FILES = {"train-images-idx3-ubyte.gz": idx_gz(RNG.integers(0, 256, (200, 28, 28))),
         "train-labels-idx1-ubyte.gz": idx_gz(RNG.integers(0, 10, 200))}
SUMS = {name: md5(body) for name, body in FILES.items()}
IMAGES = "train-images-idx3-ubyte.gz"


def leftovers(folder):
    """Every file in `folder` but the lock and the failure record (temporary files included)."""
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in (download.LOCK_NAME, download.FAILED_NAME))


def test_the_mirrors_come_from_the_environment():
    assert download.mirrors({}) == download.MIRRORS
    assert download.MIRRORS[0] == "https://ossci-datasets.s3.amazonaws.com/mnist/"
    assert download.mirrors({download.MIRRORS_ENV: ""}) == ()
    assert download.mirrors({download.MIRRORS_ENV: " http://a/x/  http://b/ "}) == (
        "http://a/x/", "http://b/")


def test_downloads_off_touch_nothing(tmp_path):
    with pytest.raises(download.DownloadError, match="downloads are off"):
        download.fetch(tmp_path / "data", SUMS, bases=())
    assert not (tmp_path / "data").exists()


def test_a_whole_download_is_verified_and_says_how_far_it_is(tmp_path):
    out = io.StringIO()
    with Mirror(FILES) as mirror:
        fetched = download.fetch(tmp_path, SUMS, bases=[mirror.url], out=out)
        assert download.fetch(tmp_path, SUMS, bases=[mirror.url], out=out) == []
        assert dict(mirror.requests) == {name: 1 for name in FILES}     # once each
    assert fetched == [tmp_path / name for name in FILES]
    assert all((tmp_path / name).read_bytes() == body for name, body in FILES.items())
    assert leftovers(tmp_path) == sorted(FILES)
    lines = out.getvalue().splitlines()
    size = len(FILES[IMAGES]) / 1e6
    assert f"downloading {mirror.url}{IMAGES}: 0.0 of {size:.1f} MB (0%)" in lines
    assert f"downloading {mirror.url}{IMAGES}: {size:.1f} of {size:.1f} MB (100%)" in lines
    assert f"downloaded {tmp_path / IMAGES} ({size:.1f} MB, md5 {SUMS[IMAGES]} as expected)" in lines


def test_a_connection_dropped_half_way_leaves_nothing_and_the_next_mirror_serves(tmp_path):
    with Mirror(FILES, drop={IMAGES}) as bad, Mirror(FILES) as good:
        with pytest.raises(download.DownloadError) as err:
            download.fetch(tmp_path / "a", SUMS, bases=[bad.url], out=io.StringIO())
        half, whole = len(FILES[IMAGES]) // 2, len(FILES[IMAGES])
        assert str(err.value) == (f"could not download {IMAGES} (127.0.0.1:"
                                  f"{bad.server.server_address[1]}: the connection closed after "
                                  f"{half:,} of {whole:,} bytes)")
        assert leftovers(tmp_path / "a") == []
        # the same files from a list whose first mirror drops: the second one's, whole
        download.fetch(tmp_path / "b", SUMS, bases=[bad.url, good.url], out=io.StringIO())
        assert (tmp_path / "b" / IMAGES).read_bytes() == FILES[IMAGES]
        assert good.requests[IMAGES] == 1 and bad.requests[IMAGES] == 2


def test_a_file_with_the_wrong_md5_is_refused_and_removed(tmp_path):
    other = dict(FILES, **{IMAGES: idx_gz(RNG.integers(0, 256, (200, 28, 28)))})
    with Mirror(other) as mirror:
        with pytest.raises(download.DownloadError) as err:
            download.fetch(tmp_path, SUMS, bases=[mirror.url, refused_url()], out=io.StringIO())
    message = str(err.value)
    assert f"md5 {md5(other[IMAGES])}, expected {SUMS[IMAGES]}" in message
    assert "Connection refused" in message                  # the second mirror was tried too
    assert leftovers(tmp_path) == []                        # nor the labels after the images


@pytest.mark.interpreter
def test_a_failure_is_said_again_not_tried_again_by_processes_started_before_it(tmp_path):
    with Mirror(FILES, drop={IMAGES}) as mirror:
        for _ in range(2):
            with pytest.raises(download.DownloadError):
                download.fetch(tmp_path, SUMS, bases=[mirror.url], out=io.StringIO())
        assert mirror.requests[IMAGES] == 1
        with pytest.raises(download.DownloadError, match=r"\(met by process \d+ \d+ s ago\)"):
            download.fetch(tmp_path, SUMS, bases=[mirror.url], out=io.StringIO())
        mirror.drop.clear()                     # fixed; a run started now tries again
        code = f"from labs.kit import download; download.fetch({str(tmp_path)!r}, {SUMS!r}, " \
               f"bases=[{mirror.url!r}])"
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
        assert mirror.requests[IMAGES] == 2 and leftovers(tmp_path) == sorted(FILES)
    assert not (tmp_path / download.FAILED_NAME).exists()


@pytest.mark.interpreter
def test_a_disk_that_refuses_the_file_is_a_clear_error_and_leaves_nothing(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes every write past 64 KiB fail as
    a full disk does: a DiskError naming it, no mirror tried after, nothing left behind."""
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from labs.kit import download
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            download.fetch({str(tmp_path)!r}, {SUMS!r}, bases=sys.argv[1:])
        except download.DiskError as err:
            print(err)
            sys.exit(7)
    """)
    with Mirror(FILES) as mirror, Mirror(FILES) as second:
        done = subprocess.run([sys.executable, "-c", script, mirror.url, second.url], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert second.requests[IMAGES] == 0
    assert done.returncode == 7, done.stdout + done.stderr
    assert f"cannot write the download of {IMAGES} in {tmp_path}: [Errno 27] File too large" \
        in done.stdout
    assert leftovers(tmp_path) == []


@pytest.mark.interpreter
def test_processes_started_together_download_each_file_once(tmp_path):
    """Four processes (the ranks of a job, or two jobs) ask for the same files at once, from a
    slow mirror: the lock lets one download; the others wait and find the files whole."""
    code = (f"from labs.kit import download; import sys; "
            f"got = download.fetch({str(tmp_path)!r}, {SUMS!r}, bases=sys.argv[1:]); "
            f"print(len(got))")
    with Mirror(FILES, slow_s=0.05) as mirror:
        procs = [subprocess.Popen([sys.executable, "-c", code, mirror.url], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
        fetched = [int(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4
        assert dict(mirror.requests) == {name: 1 for name in FILES}
    assert sorted(fetched) == [0, 0, 0, 2]
    assert all((tmp_path / name).read_bytes() == body for name, body in FILES.items())
    assert leftovers(tmp_path) == sorted(FILES)
