"""Fixtures of the router tests: the model's tokenizer, a throwaway redis-server, a loop thread."""

import pytest
from routerkit import LoopThread, RedisServer


@pytest.fixture(scope="session")
def tokenizer():
    from splitserve.platform.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_up():
    """`get(*flags)`: a running `splitserve up` with those flags, one per flag list in this test
    process, started on first use and stopped (SIGINT) at the session's end. For files that only
    send requests: each `up` costs two model loads, and the gateway files would otherwise start
    the same one each. A file that stops, reconfigures or counts from a fresh `up` runs its own
    (upkit.running_up)."""
    from upkit import UpProcess, stop

    processes: dict[tuple[str, ...], UpProcess] = {}

    def get(*flags: str) -> UpProcess:
        if flags not in processes or processes[flags].proc.poll() is not None:
            processes[flags] = UpProcess(*flags).wait()
        return processes[flags]

    yield get
    for process in processes.values():
        stop(process)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def cluster():
    """Two decode and two prefill worker processes (real model, TCP KV transport), started in
    parallel and shared by the placement and Redis replica tests. Secure, as `splitserve up`:
    mTLS on gRPC and authenticated KV transfers; routers use `tls=workerproc.security().tls`."""
    import threading

    from workerproc import WorkerProc

    workers = [WorkerProc(role, "tcp") for role in ("decode", "decode", "prefill", "prefill")]
    errors = []

    def start(w):
        try:
            w.start()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for w in workers:
            w.kill()
        raise errors[0]
    yield workers
    for w in workers:
        w.terminate()
