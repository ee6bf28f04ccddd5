"""The staged reader's Python API used wrongly: each misuse ends in a typed error or a plain answer, never a
hang, a crash or a read of freed memory. Each case runs in a child process (a crash or a hang there fails the
test instead of ending the run), with glibc filling freed memory with junk so that a use after free shows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gdsload.loader.io import staged

pytestmark = pytest.mark.skipif(staged.library_path() is None, reason="the staged reader was not built (no C compiler)")

_PRELUDE = """
import os, sys, threading
import numpy as np
from gdsload.loader import GdsloadError
from gdsload.loader.io.staged import StagedPool
path = sys.argv[1]
data = np.random.default_rng(3).integers(0, 256, 3_000_000, dtype=np.uint8)
data.tofile(path)
fd = os.open(path, os.O_RDONLY)
out = np.zeros(data.size, np.uint8)
"""


def _child(tmp_path, body: str, timeout: float = 60) -> str:
    env = {**os.environ, "MALLOC_PERTURB_": "165"}
    code = _PRELUDE + textwrap.dedent(body)
    try:
        p = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", code, str(tmp_path / "blob.bin")],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child hung (no answer in {timeout} s)")
    assert p.returncode == 0, f"the child died with {p.returncode}: {p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.parametrize(
    "offset, length, error",
    [
        (0, 2**63 - 1, "TruncatedFileError"),  # past the end of the file: refused before the pool sees it
        (1, 2**63 - 1, "StagedRangeError"),  # past 2**63 - 1
        (-1, 10, "StagedRangeError"),
        (0, -5, "StagedRangeError"),
    ],
)
def test_a_range_no_file_holds_is_a_typed_error_at_once(tmp_path, offset, length, error):
    out = _child(
        tmp_path,
        f"""
        with StagedPool(None, threads=2, chunk=4096, buffers=1) as eng:
            try:
                eng.submit([(fd, {offset}, {length}, out.ctypes.data)], [path])()
            except GdsloadError as e:
                print(type(e).__name__, "|", e)
            eng.submit([(fd, 0, data.size, out.ctypes.data)], [path])()  # the pool goes on
        assert (out == data).all()
        print("ok")
    """,
    )
    assert out.startswith(error) and "blob.bin" in out and out.rstrip().endswith("ok"), out


def test_a_huge_length_on_a_descriptor_without_a_size_is_refused_by_the_pool(tmp_path):
    """A pipe has no size to check against: the pool itself refuses a range of 2**63 - 1 bytes (it would need
    2**42 chunks), where it used to loop forever growing its queue."""
    out = _child(
        tmp_path,
        """
        r, w = os.pipe()
        with StagedPool(None, threads=1, chunk=2 << 20, buffers=1) as eng:
            try:
                eng.submit([(r, 0, 2**63 - 1, out.ctypes.data)], ["/models/pipe"])()
            except GdsloadError as e:
                print(type(e).__name__, "|", e)
    """,
    )
    assert out.startswith("StagedRangeError") and "2**26 chunks" in out, out


def test_a_waiter_called_after_close_answers(tmp_path):
    """The reads were finished by close(); their waiter then returns (or raises their error), without touching
    the pool that is gone."""
    out = _child(
        tmp_path,
        """
        eng = StagedPool(None, threads=2, chunk=65536, buffers=2)
        wait = eng.submit([(fd, 0, data.size, out.ctypes.data)], [path])
        eng.close()
        wait()
        wait()
        assert (out == data).all()
        try:
            eng.submit([(fd, 0, 10, out.ctypes.data)], [path])
        except GdsloadError as e:
            print(type(e).__name__, "|", e)
        print("ok")
    """,
    )
    assert out.startswith("StagedReaderError | the staged reader is closed") and out.rstrip().endswith("ok"), out


def test_waiting_twice_or_from_two_threads_gives_one_outcome(tmp_path):
    out = _child(
        tmp_path,
        """
        short = os.open(path, os.O_RDONLY)
        with StagedPool(None, threads=3, chunk=65536, buffers=2) as eng:
            wait = eng.submit([(fd, 0, data.size, out.ctypes.data)], [path])
            wait()
            wait()  # the ticket was freed by the first: this must not wait on it again
            errors = []
            again = np.zeros(data.size, np.uint8)
            shared = eng.submit([(short, 0, data.size, again.ctypes.data)], [path])
            ths = [threading.Thread(target=lambda: errors.append(shared() or "none")) for _ in range(4)]
            [t.start() for t in ths]
            [t.join() for t in ths]
            print(errors)
            assert (again == data).all()
        print("ok")
    """,
    )
    assert "['none', 'none', 'none', 'none']" in out and out.rstrip().endswith("ok"), out


def test_a_read_error_is_given_to_every_waiter_and_after_close(tmp_path):
    out = _child(
        tmp_path,
        """
        eng = StagedPool(None, threads=2, chunk=4096, buffers=1)
        r, w = os.pipe()
        wait = eng.submit([(r, 0, 100, out.ctypes.data)], ["/models/a.safetensors"])
        eng.close()
        for _ in range(2):
            try:
                wait()
            except GdsloadError as e:
                print(type(e).__name__, "|", e)
    """,
    )
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("FileUnreadableError") and "ESPIPE" in line for line in lines), out


def test_a_progress_callback_that_closes_the_pool(tmp_path):
    """A waiter's progress callback that closes the pool: the wait ends with the reads' outcome, no deadlock."""
    out = _child(
        tmp_path,
        """
        eng = StagedPool(None, threads=1, chunk=4096, buffers=1)
        seen = []
        def progress(n):
            seen.append(n)
            eng.close()
        eng.submit([(fd, 0, data.size, out.ctypes.data)], [path], progress)()
        assert (out == data).all() and sum(seen) == data.size, (sum(seen), data.size)
        print("ok")
    """,
    )
    assert out.strip() == "ok", out
