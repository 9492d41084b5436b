"""The kernels' thread pool (src/redlite/kernels/pool.c), through a small C program that includes
it (tests/pool_race.c), built with the compiler and flags of the kernels.

The pool's caller and workers claim chunks of a job with a compare-and-swap on one word
(generation, next index). A worker that had read the word of a finished job and resumed late
could read the next job's size and claim its indices under the finished job's generation: that
chunk ran twice and was counted into the next job's done count, so pool_run could return while
a chunk still ran on the caller's stack frame or on freed buffers (a crash, or wrong values).
It needs the caller to be preempted between writing the next job's fields and publishing its
generation: an instrumented server on a loaded 2-core machine logged such claims (29 in one
7-minute run, none in another 5-minute one). Finished jobs are now retired.

A worker preempted while it holds a chunk makes the caller wait a scheduler time slice: after
such a wait, or while other work takes the caller's core, the caller runs the next jobs alone
for a while.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from redlite.kernels import native

HERE = Path(__file__).resolve().parent
KERNELS = Path(native.__file__).resolve().parent

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler / AVX2 for the kernels")


@pytest.fixture(scope="module")
def pool_program(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    program = tmp_path_factory.mktemp("pool") / "pool_race"
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *flags, "-I", str(KERNELS), "-o", str(program), str(HERE / "pool_race.c")],
                   check=True, capture_output=True, timeout=120)
    return program


def run(program: Path, *args: str) -> list[int]:
    done = subprocess.run([str(program), *args], check=True, capture_output=True, text=True, timeout=60)
    return [int(v) for v in done.stdout.split()]


def test_a_late_worker_claims_nothing_of_the_next_job(pool_program: Path) -> None:
    # before the fix: 1 (indices 9..44 of the next job claimed under the finished generation)
    assert run(pool_program, "stale") == [0]


def test_every_index_runs_once_while_jobs_alternate_in_size(pool_program: Path) -> None:
    twice, missing, after_return = run(pool_program, "stress", "1.0")
    assert (twice, missing, after_return) == (0, 0, 0)


def test_after_a_worker_stalls_the_caller_runs_jobs_alone_then_shares_again(pool_program: Path) -> None:
    # a worker preempted while it holds a chunk makes the caller wait; alone it would not
    during, later = run(pool_program, "solo")
    assert (during, later) == (0, 1)


def test_while_other_work_shares_its_core_the_caller_runs_jobs_alone(pool_program: Path) -> None:
    assert run(pool_program, "share") == [1]
