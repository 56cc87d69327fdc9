"""The CPU experts server a GPU step asks through a mailbox (lumen_cpu/_native_serve.c, lumen_cpu.hostjob), driven
from the host here (``Server.ask`` does what the GPU's kernels do: inputs in the mailbox, seq bumped, done awaited).
Its answers must equal moe_fused's one-token path to the bit: the same C worker, the same weighted sum in slot
order. The GPU side (kernels/hostcall.cu) is tested in tests/test_cuda_stream.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lumen_core.backend import Weight, scale_block
from lumen_core.quantize import quantize_nvfp4

native = pytest.importorskip("lumen_cpu.native")
F32 = np.float32


@pytest.fixture(autouse=True)
def built():
    assert native.available, ("lumen_cpu's C kernels were not built: `pip install -e plugins/lumen-cpu` compiles "
                              "them and needs a C compiler (gcc / clang)")
    from lumen_cpu import hostjob

    assert hostjob.available(), "the C library was built without its experts server (_native_serve.c)"


def experts(rng, fmt, E, H, I):
    from lumen_cpu import nvfp4

    def one(N, K):
        if fmt == "fp8":
            data = (rng.normal(size=(N, K)) * 40).astype(ml_dtypes.float8_e4m3fn)
            s = rng.uniform(0.5, 2, size=(-(-N // 32), -(-K // 32))).astype(F32) * 0.01
            return Weight(data, "fp8", (N, K), s, scale_block((N, K), s.shape))
        packed, bs, gs = quantize_nvfp4(rng.normal(size=(N, K)).astype(F32) * 0.1)
        return nvfp4.weight(packed, (bs, gs), (N, K), "ram", qx=fmt == "nvfp4-q8")

    return [(one(I, H), one(I, H)) for _ in range(E)], [one(H, I) for _ in range(E)]


class Box:
    """A mailbox in ordinary memory and its server."""

    def __init__(self, threads):
        from lumen_cpu import hostjob

        self.lay = hostjob.layout()
        self.words = np.zeros(self.lay["bytes"] // 8, np.uint64)
        self.server = hostjob.Server(self.words.ctypes.data, self.words, threads)
        self.raw = self.words.view(np.uint8)

    def view(self, name, dtype, n):
        off = self.lay[name]
        return self.raw[off:off + n * np.dtype(dtype).itemsize].view(dtype)

    def ask(self, index, x, ids, w):
        self.view("x", F32, x.size)[:] = x.reshape(-1)
        self.view("ids", np.int64, ids.size)[:] = ids.reshape(-1)
        self.view("wts", F32, w.size)[:] = w.reshape(-1)
        self.server.ask(index)
        return self.view("out", F32, x.size).copy()


def shapes(H, k):
    return [((1, H), np.dtype(F32)), ((1, k), np.dtype(np.int64)), ((1, k), np.dtype(F32))]


def small_job(seed, fmt, threads, H=64, I=32, k=2):
    """(fn: a 4-expert layer's one-token experts, a Box of ``threads`` threads with fn registered, its number, rng)."""
    from lumen_cpu import hostjob, moe_fused

    rng = np.random.default_rng(seed)
    gate_up, down = experts(rng, fmt, 4, H, I)

    def fn(x, ids, w):
        return moe_fused.experts(x, ids, w, gate_up, down)

    box = Box(threads)
    return fn, box, box.server.add(hostjob.record(fn, shapes(H, k))), rng


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "nvfp4-q8"])
@pytest.mark.parametrize("H,I,threads", [(2048, 512, 3), (80, 48, 1)])
def test_served_experts_equal_the_one_token_path_bit_for_bit(fmt, H, I, threads):
    from lumen_cpu import hostjob, moe_fused

    rng = np.random.default_rng(H + I + len(fmt))
    E, k = 12, 4
    gate_up, down = experts(rng, fmt, E, H, I)
    box = Box(threads)
    jobs = {}
    for act in ("silu", "gelu_tanh"):
        def fn(x, ids, w, act=act):
            return moe_fused.experts(x, ids, w, gate_up, down, act)

        job = hostjob.record(fn, shapes(H, k))
        assert job is not None
        jobs[act] = (fn, box.server.add(job))
    assert sorted(i for _, i in jobs.values()) == [0, 1]
    box.server.arm(8)
    for trial, ids in enumerate(([[3, 11, 7, 0]], [[5, 5, 2, 9]], [[1, -1, 4, E]])):  # -1, E: slots skipped
        ids = np.array(ids)
        x = rng.normal(size=(1, H)).astype(F32)
        w = rng.uniform(size=(1, k)).astype(F32)
        for act, (fn, index) in jobs.items():
            want = fn(x, ids, w)
            got = box.ask(index, x, ids, w)
            assert np.array_equal(got, want[0]), (fmt, act, trial, np.abs(got - want[0]).max())
    box.server.close()


def test_only_one_native_call_returned_as_is_is_a_job():
    from lumen_cpu import hostjob, moe_fused

    rng = np.random.default_rng(0)
    H, I, k = 64, 32, 2
    gate_up, down = experts(rng, "fp8", 4, H, I)
    one = shapes(H, k)
    assert hostjob.record(lambda x, i, w: moe_fused.experts(x, i, w, gate_up, down), one) is not None
    assert hostjob.record(lambda x, i, w: moe_fused.experts(x, i, w, gate_up, down) * 2, one) is None
    assert hostjob.record(lambda x, i, w: moe_fused.experts(x, i, w, gate_up, down)
                          + moe_fused.experts(x, i, w, gate_up, down), one) is None
    two = [((2, H), np.dtype(F32)), ((2, k), np.dtype(np.int64)), ((2, k), np.dtype(F32))]
    assert hostjob.record(lambda x, i, w: moe_fused.experts(x, i, w, gate_up, down), two) is None  # not one token
    assert hostjob.recorder() is None  # nothing left recording on this thread


def test_an_unknown_job_is_answered_with_an_error_not_a_hang():
    box = Box(2)
    x = np.ones((1, 16), F32)
    box.view("out", F32, 16)[:] = 7
    box.ask(3, x, np.zeros((1, 2), np.int64), np.ones((1, 2), F32))  # no job registered
    assert int(box.words[9]) == 4  # the server's error word: the job number + 1
    assert np.all(box.view("out", F32, 16) == 7)
    box.server.close()


def test_an_unarmed_server_still_answers_and_close_stops_its_threads():
    """Without arm() the threads sleep; the leader polls every 2 ms, so a job asked anyway is served (late)."""
    fn, box, index, rng = small_job(1, "nvfp4", 3)
    H, k = 64, 2
    x, ids, w = rng.normal(size=(1, H)).astype(F32), np.array([[2, 0]]), np.ones((1, k), F32)
    assert np.array_equal(box.ask(index, x, ids, w), fn(x, ids, w)[0])
    box.server.close()  # joins the threads (a hang here hangs the run: a failure CI reports)
    box.server.close()  # idempotent


def test_asks_armed_or_not_in_a_row_never_hang():
    """Hundreds of jobs, the threads going to sleep (not armed, or armed and served) and waking between them: a
    missed wake-up would hang one ask for good; the thread asking is given two minutes."""
    import threading

    # more threads than this machine's cores in CI (2): the leader waits for parked ones too
    fn, box, index, rng = small_job(2, "fp8", 3)
    H, k = 64, 2
    x, ids, w = rng.normal(size=(1, H)).astype(F32), np.array([[3, 1]]), np.ones((1, k), F32)
    want, got = fn(x, ids, w)[0], []

    def run():
        for i in range(300):
            if i % 3:
                box.server.arm(1)
            got.append(box.ask(index, x, ids, w))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and len(got) == 300
    assert all(np.array_equal(g, want) for g in got)
    box.server.close()


@pytest.mark.parametrize("trial", range(4))
def test_close_serves_the_jobs_armed_and_still_coming(trial):
    """An engine dropped with GPU steps still queued: close() waits until the armed jobs are asked and served,
    instead of leaving the GPU's waits to their timeout. The asker of the last job must find its answer although
    close frees the server right after it (it read the answer through the freed server once: a crash in about one
    run in four, hence the trials)."""
    import threading
    import time

    fn, box, index, rng = small_job(3, "nvfp4", 2)
    H, k = 64, 2
    x, ids, w = rng.normal(size=(1, H)).astype(F32), np.array([[0, 3]]), np.ones((1, k), F32)
    box.server.arm(3)
    got, handle, lib = [], box.server._handle, box.server._lib

    def gpu():  # three crossings, 0.2 s apart, the last long after close() was called
        for _ in range(3):
            time.sleep(0.2)
            box.view("x", F32, H)[:] = x[0]
            box.view("ids", np.int64, k)[:] = ids[0]
            box.view("wts", F32, k)[:] = w[0]
            lib.lumen_serve_ask(handle, index)  # as Server.ask, past the closing Server's checks
            got.append(box.view("out", F32, H).copy())

    t = threading.Thread(target=gpu, daemon=True)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    box.server.close()
    waited = time.perf_counter() - t0
    t.join(30)
    assert not t.is_alive() and len(got) == 3
    assert 0.4 < waited < 5, waited
    assert all(np.array_equal(g, fn(x, ids, w)[0]) for g in got)


def test_the_trace_holds_each_job_served_in_order_with_its_timestamps():
    """Server.trace (profiling a step's crossings): one row a job served, oldest first, its times in order; cooled
    counts the times the threads gave up on jobs armed but never asked."""
    import time

    fn, box, index, rng = small_job(4, "fp8", 2)
    H, k = 64, 2
    x, ids, w = rng.normal(size=(1, H)).astype(F32), np.array([[1, 2]]), np.ones((1, k), F32)
    assert box.server.trace()["rows"].shape == (0, 5)
    box.server.arm(5)
    for _ in range(5):
        box.ask(index, x, ids, w)
    box.ask(7, x, ids, w)  # unknown: answered, not traced
    t = box.server.trace()
    assert t["served"] == 5 and t["cooled"] == 0 and t["rows"].shape == (5, 5)
    rows = t["rows"]
    assert (rows[:, 0] == index).all()
    assert (np.diff(rows[:, 1:], axis=1) >= 0).all() and (rows[1:, 1] >= rows[:-1, 4]).all()
    assert box.server.trace(2)["rows"].tolist() == rows[-2:].tolist()
    box.server.arm(1)  # never asked: the threads cool after a second
    time.sleep(1.5)
    assert box.server.trace()["cooled"] == 1
    box.server.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.server.trace()
