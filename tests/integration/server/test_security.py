"""Security: nothing in tandem unpickles what another process can write (a code scan, and pickle
payloads smuggled to every port of a running server), shared-memory segments are owner-only with
unguessable names, everything binds loopback by default, and /admin needs the admin key."""

import ast
import dataclasses
import fcntl
import hmac
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from starlette.requests import Request

from support.paths import SRC, SUPPORT
from support.serving import ADMIN_KEY, Server, descendants
from tandem.config import EngineConfig
from tandem.engine.control import ControlServer, connect
from tandem.engine.messages import CONTROL, Hello, Start
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PUSH, PushDone, PushHello
from tandem.exchange.settings import PushSettings
from tandem.exchange.transports import shm
from tandem.server import state as server_state
from tandem.server.config import ServeConfig
from tandem.server.errors import APIError
from tandem.server.state import require_admin
from tandem.wire import frame

pytestmark = pytest.mark.timeout(300)

# -- (a) no unsafe deserialisation or code execution in the package ----------------------------

PICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}


def unsafe_code(source: str, filename: str = "<src>") -> list[str]:
    """Every pickle-family import, `torch.load` without ``weights_only=True``, `numpy.load`
    with ``allow_pickle``, eval/exec, and shell command lines in ``source``."""
    tree = ast.parse(source, filename)
    names: dict[str, str] = {}  # local name -> what it was imported as
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
                if a.name.split(".")[0] in PICKLERS:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
            if (node.module or "").split(".")[0] in PICKLERS or PICKLERS & {
                a.name for a in node.names
            }:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return names.get(node.id, node.id)
        if isinstance(node, ast.Attribute) and (base := dotted(node.value)):
            return f"{base}.{node.attr}"
        return None

    def keyword(call: ast.Call, name: str):
        kw = next((k for k in call.keywords if k.arg == name), None)
        return None if kw is None else kw.value.value if isinstance(kw.value, ast.Constant) else ...

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (func := dotted(node.func)) is None:
            continue
        bad = (
            (func == "torch.load" and keyword(node, "weights_only") is not True)
            or (func in ("numpy.load", "numpy.lib.npyio.load") and keyword(node, "allow_pickle"))
            or func in ("eval", "exec", "builtins.eval", "builtins.exec", "os.system", "os.popen")
            or (func.startswith("subprocess.") and keyword(node, "shell") not in (None, False))
        )
        if bad:
            found.append(f"{filename}:{node.lineno}: {func}(...)")
    return found


def test_package_never_unpickles_or_evaluates():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    found = [f for path in files for f in unsafe_code(path.read_text(), str(path.relative_to(SRC)))]
    assert not found, "unsafe code:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import dill as d",
        "from marshal import loads",
        "from shelve import open",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "from torch import load\nload(f)",
        "import torch as t\nt.load(f, **kw)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "eval('1')",
        "exec(code)",
        "import subprocess\nsubprocess.run('ls', shell=True)",
        "import os\nos.system('ls')",
    ],
)
def test_scan_catches(snippet):
    assert unsafe_code(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "model.eval()",
        "import torch\ntorch.load(f, weights_only=True)",
        "import numpy as np\nnp.load(f)",
        "import subprocess\nsubprocess.run(['ls'], shell=False)",
    ],
)
def test_scan_allows(snippet):
    assert not unsafe_code(snippet)


# -- (b) pickle payloads smuggled to every port of a running server ----------------------------


class _CreatesFile:
    """Unpickling this creates ``path``: the proof that someone unpickled it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def server(model_factory):
    model = model_factory("llama", max_position_embeddings=128)
    with Server(model, "--admin-key", ADMIN_KEY) as s:
        s.model_dir = model  # what a trainer pushes back
        yield s


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in these processes (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hexaddr, hexport = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(hexport, 16)))
    return found


def send_raw(host: str, port: int, data: bytes) -> bytes:
    """Send ``data``, close our side, return whatever comes back before the peer closes."""
    reply = b""
    with socket.create_connection((host, port), timeout=30) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                raise
    return reply  # the peer closed: it read no further


def test_pickle_payloads_are_never_unpickled(server, tmp_path):
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps(_CreatesFile(str(marker)), protocol=p) for p in (0, 2, 5)]
    pickle.loads(payloads[0])  # the payload is live: unpickling it does create the file
    assert marker.exists()
    marker.unlink()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for payload in payloads:
        for ctype in ("application/octet-stream", "application/python-pickle", "application/json"):
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = server.post(path, content=payload, headers={"content-type": ctype})
                assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text
        for method, path in (("GET", "/admin/weights"), ("POST", "/sleep"), ("POST", "/wake_up")):
            r = server.client.request(method, path, content=payload, headers=admin)
            assert r.status_code < 500, r.text
        for path in ("/pause", "/abort_requests"):
            r = server.client.post(path, content=payload, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text
    ex = server.admin("GET", "/admin/weights").json()["exchange"]
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    ports = {port for _, port in listening(pids)} - {int(server.url.rsplit(":", 1)[1])}
    assert ex["port"] in ports  # worker control listeners close once every rank has connected
    for port in ports:
        for payload in payloads:
            send_raw("127.0.0.1", port, payload)
            send_raw("127.0.0.1", port, frame(payload))
    # The right token, then a hello with a pickle for a layout: refused as it is decoded
    token = frame(ex["token"].encode())
    hello = ["hello", 0, 1, None, payloads[2], [], ["shm", "staged", False]]
    assert send_raw(ex["host"], ex["port"], token + frame(msgpack.packb(hello))) == b""
    # ... and inside plain data the hello may carry (a layout's arena handle): the push fails
    hello = PushHello(0, 1, None, RankLayout(0, arena=[payloads[2]]), [], PushSettings("shm"))
    reply = send_raw(ex["host"], ex["port"], token + frame(PUSH.encode(hello)))
    done = PUSH.decode(reply[4:])
    assert isinstance(done, PushDone) and done.error, done
    assert not marker.exists()
    assert server.get("/health").json()["status"] == "ok"
    legitimate_push_still_works(server, version=1)


JUNK = [  # each used to kill the exchange server's thread: later pushes hung
    msgpack.packb(1),
    msgpack.packb([]),
    msgpack.packb(["hello"]),
    msgpack.packb([[1], 2]),
    msgpack.packb(5),
    "ключ".encode(),
    msgpack.packb({"hello": 1}),
    b"\xc1",
    b"",
]
# ... and a well-formed hello sent without the token first
HELLO = PushHello(0, 1, None, RankLayout(0), [], PushSettings("shm", "staged", False))
MALFORMED = [*JUNK, PUSH.encode(HELLO)]


def test_malformed_frames_do_not_stop_the_exchange_server(server):
    ex = server.admin("GET", "/admin/weights").json()["exchange"]
    token = frame(ex["token"].encode())
    for data in MALFORMED:
        assert send_raw(ex["host"], ex["port"], frame(data)) == b""  # dropped, no reply
    for data in JUNK:
        assert send_raw(ex["host"], ex["port"], token + frame(data)) == b""  # token, then junk
    bad_rank = ["hello", [0], 1, None, [0, [], {}, "float32", None], [], ["shm", "staged", False]]
    assert send_raw(ex["host"], ex["port"], token + frame(msgpack.packb(bad_rank))) == b""
    out_of_world = dataclasses.replace(HELLO, rank=1)
    assert send_raw(ex["host"], ex["port"], token + frame(PUSH.encode(out_of_world))) == b""
    version = server.admin("GET", "/admin/weights").json()["version"]
    legitimate_push_still_works(server, version=version + 1)


def legitimate_push_still_works(server, version: int) -> None:
    cmd = [
        sys.executable,
        str(SUPPORT / "http_trainer.py"),
        server.model_dir,
        server.url,
        "shm",
        ADMIN_KEY,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert server.admin("GET", "/admin/weights").json()["version"] == version
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["weight_version"] == version, r.text


def accepts_its_worker_after(strangers) -> None:
    """A one-rank `ControlServer` accepts its worker after ``strangers(host, port)`` ran."""
    server = ControlServer("127.0.0.1", "control-token", world_size=1)
    host, port = server.address
    worker = []

    def strangers_then_worker():
        strangers(host, port)
        worker.append(connect(host, port, "control-token", Hello(0, os.getpid())))

    thread = threading.Thread(target=strangers_then_worker, daemon=True)
    thread.start()
    try:
        server.accept_all(time.monotonic() + 60, check_alive=lambda: None)
        assert list(server.peers) == [0]
    finally:
        thread.join(60)
        for sock in worker:
            sock.close()
        server.close()


def test_control_server_drops_strangers_and_accepts_its_worker():
    def strangers(host, port):
        for data in [*MALFORMED, pickle.dumps(_CreatesFile("/nonexistent/x"))]:
            send_raw(host, port, frame(data))
        for data in [*MALFORMED, CONTROL.encode(Hello(7, 1))]:  # token, then junk / rank 7
            send_raw(host, port, frame(b"control-token") + frame(data))
        send_raw(host, port, frame(b"wrong-token") + frame(CONTROL.encode(Hello(0, 1))))

    accepts_its_worker_after(strangers)


# -- (c) shared memory: nameless, checked when mapped ------------------------------------------


def test_shared_memory_is_nameless_and_a_mapping_checks_what_it_opens():
    before = set(os.listdir("/dev/shm"))
    memory = shm.SharedMemory(4096)
    assert set(os.listdir("/dev/shm")) == before  # no name: nothing to plant, guess or leave
    assert os.readlink(f"/proc/self/fd/{memory.fd}").startswith("/memfd:")
    pid, fd, inode, size = memory.handle()
    memory.data[:4].copy_(memory.data.new_tensor([1, 2, 3, 4]))
    mapped = shm.MappedMemory([pid, fd, inode, size])
    assert mapped.data[:4].tolist() == [1, 2, 3, 4]
    bad = [
        [pid, fd, inode + 1, size],
        [pid, fd, inode, size + 1],
        [pid, 0, inode, size],
        [2**22 + 7, fd, inode, size],
    ]
    for wire in bad:  # a recycled descriptor or pid, a wrong size: refused before mapping
        with pytest.raises(RuntimeError):
            shm.MappedMemory(wire)
    for offset, nbytes in ((size - 1, 2), (-1, 1)):  # records never reach past the buffer
        with pytest.raises(ValueError):
            mapped.view(offset, nbytes)


# -- (d) loopback by default ----------------------------------------------------------------


def non_loopback_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
        if not addr.startswith("127."):
            return addr
    return None


def test_everything_binds_loopback_by_default(server):
    assert ServeConfig.model_fields["host"].default == "127.0.0.1"
    assert EngineConfig.model_fields["exchange_host"].default == "127.0.0.1"
    assert EngineConfig(model="m").parallel.master_addr == "127.0.0.1"
    server.admin("GET", "/admin/weights")  # the exchange server is listening now
    bound = listening([server.proc.pid, *descendants(server.proc.pid)])
    assert len(bound) == 2 and all(addr == "127.0.0.1" for addr, _ in bound), bound
    addr = non_loopback_ipv4()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    for _, port in bound:
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=5).close()


# -- (e) unauthenticated peers cannot make a listener allocate --------------------------------

FLOOD_BYTES = 150 << 20
CUT_OFF = 32 << 20  # what loopback's socket buffers can take after the listener stopped reading


def flood(host: str, port: int, prefix: bytes = b"") -> int:
    """Connect, send ``prefix`` and a header announcing a 1 GiB frame, then stream zeros; the
    bytes sent before the listener cut us off (all of FLOOD_BYTES if it kept reading)."""
    sent, chunk = 0, bytes(1 << 20)
    with socket.create_connection((host, port), timeout=30) as sock:
        try:
            sock.sendall(prefix + struct.pack("!I", 1 << 30))
            while sent < FLOOD_BYTES:
                sent += sock.send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return sent


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def floods(host: str, port: int, count: int = 3, prefix: bytes = b"") -> list[int]:
    out = [0] * count

    def one(i):
        out[i] = flood(host, port, prefix)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_frames_grow_with_what_arrives_not_with_what_the_header_announces():
    import tracemalloc

    from tandem.wire import PeerGone, recv_frame

    ours, theirs = socket.socketpair()

    def send():
        with theirs:
            theirs.sendall(struct.pack("!I", 1 << 30) + bytes(1 << 20))

    with ours:
        tracemalloc.start()
        sender = threading.Thread(target=send)
        sender.start()
        try:
            with pytest.raises(PeerGone):
                recv_frame(ours)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            sender.join(30)
    assert peak < 16 << 20, f"{peak >> 20} MiB allocated for 1 MiB received"


def test_a_listener_reads_only_a_small_token_frame_before_authentication():
    from tandem.wire import MAX_HELLO, TOKEN_FRAME_MAX, accept_hello, send_frame, send_token

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    host, port = listener.getsockname()[:2]
    with listener:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(sent=flood(host, port)))
        thread.start()
        assert accept_hello(listener, "tok", CONTROL, Hello, timeout=10) is None
        thread.join(60)
        assert result["sent"] < CUT_OFF, f"the listener read {result['sent'] >> 20} MiB"
        too_long = frame(b"x" * (TOKEN_FRAME_MAX + 1))
        for first in (too_long, frame(b"tok" + b"\0"), frame(b"to")):
            client = socket.create_connection((host, port))
            client.sendall(first)
            assert accept_hello(listener, "tok", CONTROL, Hello, timeout=10) is None
            client.close()
        too_big = CONTROL.encode(Hello(0, 1)) + bytes(MAX_HELLO)  # after the token: capped too
        for hello in (CONTROL.encode(Start(1)), too_big, b"junk"):
            client = socket.create_connection((host, port))
            send_token(client, "tok")
            send_frame(client, hello)
            assert accept_hello(listener, "tok", CONTROL, Hello, timeout=10) is None
            client.close()
        client = socket.create_connection((host, port))
        send_token(client, "tok")
        send_frame(client, CONTROL.encode(Hello(0, 1)))
        sock, hello = accept_hello(listener, "tok", CONTROL, Hello, timeout=10)
        assert hello == Hello(0, 1) and sock.gettimeout() is None
        sock.close()
        client.close()


def test_unauthenticated_floods_do_not_grow_the_engine(server):
    """Three strangers announce 1 GiB frames on the exchange port and stream 150 MiB each,
    all at once: each is cut off after its header, the engine process does not grow, and the
    server still serves."""
    ex = server.admin("GET", "/admin/weights").json()["exchange"]
    before = rss(server.proc.pid)
    sent = floods(ex["host"], ex["port"])
    grown = rss(server.proc.pid) - before
    assert all(s < CUT_OFF for s in sent), [s >> 20 for s in sent]
    assert grown < 64 << 20, f"the engine grew by {grown >> 20} MiB"
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    assert server.post("/v1/completions", json=body).status_code == 200


def test_control_server_cuts_off_floods_and_accepts_its_worker():
    sent: list[int] = []
    accepts_its_worker_after(lambda host, port: sent.extend(floods(host, port)))
    assert len(sent) == 3 and all(s < CUT_OFF for s in sent), [s >> 20 for s in sent]


# -- (f) admin routes ---------------------------------------------------------------------------


def test_admin_routes_need_the_admin_key(server):
    wrong = [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": ADMIN_KEY},
        {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"},
        {"Authorization": f"Basic {ADMIN_KEY}"},
    ]
    routes = [("GET", "/admin/weights"), ("GET", "/is_paused"), ("GET", "/is_sleeping")] + [
        ("POST", p)
        for p in (
            "/sleep",
            "/wake_up",
            "/pause",
            "/resume",
            "/abort_requests",
            "/reset_prefix_cache",
            "/reload_weights",
        )
    ]
    for method, path in routes:
        for headers in wrong:
            r = server.client.request(method, path, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert server.get("/health").json()["sleeping"] is False


def _request(admin_key: str | None, authorization: str | None = None) -> Request:
    config = ServeConfig(model="m", admin_key=admin_key)
    app = SimpleNamespace(state=SimpleNamespace(tandem=SimpleNamespace(config=config)))
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "app": app, "headers": headers})


def test_admin_disabled_is_403_and_the_key_is_compared_in_constant_time(monkeypatch):
    with pytest.raises(APIError) as denied:
        require_admin(_request(None, f"Bearer {ADMIN_KEY}"))
    assert denied.value.status == 403
    compared = []

    def spy(a, b):
        compared.append((a, b))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr(server_state, "hmac", SimpleNamespace(compare_digest=spy))
    require_admin(_request(ADMIN_KEY, f"Bearer {ADMIN_KEY}"))
    with pytest.raises(APIError) as wrong:
        require_admin(_request(ADMIN_KEY, "Bearer x" + ADMIN_KEY))
    assert wrong.value.status == 401 and len(compared) == 2
