"""torchrun's stores listen on 127.0.0.1 unless the user names an address: the command line, the environment, and a
real two-rank launch whose listening sockets are read from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eyrie.core.torchrun import BIND_ENV, DISTRIBUTED_ENV, torchrun_command


def test_the_command_binds_loopback_by_default():
    command, env = torchrun_command("pkg.mod", "args.json", 2, environ={"PATH": "/bin"})
    assert command[:3] == [sys.executable, "-m", "eyrie.core.torchrun"]
    assert command[command.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert command[command.index("--master-addr") + 1] == "127.0.0.1"
    assert command[command.index("--nproc_per_node") + 1] == "2"
    assert command[-3:] == ["-m", "pkg.mod", "args.json"]
    assert "--standalone" not in command  # it would put the rendezvous on "localhost", bound on every interface
    assert env[BIND_ENV] == "127.0.0.1" and env["PATH"] == "/bin"
    assert all(env[k] == v for k, v in DISTRIBUTED_ENV.items())


def test_an_address_the_user_names_is_used():
    command, env = torchrun_command("pkg.mod", "a.json", 2, environ={"MASTER_ADDR": "10.1.2.3"})
    assert command[command.index("--rdzv-endpoint") + 1] == "10.1.2.3:0"
    assert command[command.index("--master-addr") + 1] == "10.1.2.3"
    assert env[BIND_ENV] == "10.1.2.3"
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env  # the ranks use the network the user named


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the loopback interface is named lo on Linux")
def test_the_ranks_own_sockets_stay_on_loopback_unless_the_user_chose_an_interface():
    _, env = torchrun_command("pkg.mod", "a.json", 2, environ={})
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    _, env = torchrun_command("pkg.mod", "a.json", 2, environ={"MASTER_ADDR": "127.0.0.1", "NCCL_SOCKET_IFNAME": "ib0"})
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "ib0"


def test_training_launches_through_the_same_command(monkeypatch, tmp_path):
    from eyrie.training import distributed

    seen = {}

    def fake_run(command, env, **kwargs):
        seen.update(command=command, env=env)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    distributed.launch_data_parallel({"x": 1}, 2, tmp_path / "args.json")
    assert seen["command"][:3] == [sys.executable, "-m", "eyrie.core.torchrun"]
    assert seen["env"][BIND_ENV] == "127.0.0.1" and "eyrie.training.train" in seen["command"]


RANK = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")
go = Path(sys.argv[1])
Path(str(go) + f".ready{os.environ['RANK']}").write_text(f"{os.getppid()} {os.getpid()}")
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


def _listening(pid: int) -> list[str]:
    """The local addresses process `pid` listens on (TCP, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr = fields[1].split(":")[0]
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc (Linux)")
def test_a_real_launch_listens_on_loopback_only(tmp_path, monkeypatch):
    (tmp_path / "rank_probe.py").write_text(textwrap.dedent(RANK))
    go = tmp_path / "go"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    command, env = torchrun_command("rank_probe", go, 2)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        ready = [Path(f"{go}.ready{r}") for r in (0, 1)]
        while not all(p.exists() for p in ready):
            assert process.poll() is None, process.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        agent = int(ready[0].read_text().split()[0])  # the ranks' parent: torchrun's agent, which hosts the stores
        addresses = _listening(agent)
        assert addresses, "the agent hosts the rendezvous store: it must listen somewhere"
        assert set(addresses) == {"127.0.0.1"}, addresses
        for path in ready:  # each rank's own gloo sockets
            rank = int(path.read_text().split()[1])
            assert set(_listening(rank)) <= {"127.0.0.1"}, (path.name, _listening(rank))
        go.write_text("")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
