"""Run a package module as several ranks on this machine under torchrun, its keyword arguments in a JSON file.

Used by hidden-state extraction with hidden.tensor_parallel (eyrie.hidden.parallel) and by training with
train.processes (eyrie.training.distributed.launch_data_parallel, which appends the ranks' output to the log file
instead); both take their command line and environment from `torchrun_command`.

The ranks meet through TCP stores that torchrun's agent hosts. torch binds those to every interface whatever host it
is given, so anyone who can reach the machine could write into a run. This module is also the launcher: run as
`python -m eyrie.core.torchrun ...` it hands each store a socket already bound to one address (127.0.0.1 unless the
environment names another in MASTER_ADDR), then runs torchrun itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Keep NVLink multicast off in every rank: on shared multi-GPU hosts a program using it can take the GPUs down.
DISTRIBUTED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LOOPBACK = "127.0.0.1"
BIND_ENV = "EYRIE_TORCHRUN_BIND"  # the address the launcher binds its stores to (set by torchrun_command)


def bind_address(environ: dict | None = None) -> str:
    """Where the ranks' stores listen: the address the user named in MASTER_ADDR, else 127.0.0.1."""
    environ = os.environ if environ is None else environ
    return environ.get("MASTER_ADDR") or LOOPBACK


def torchrun_command(module: str, args_path: str | Path, processes: int, environ: dict | None = None) -> tuple[list[str], dict]:
    """The command line and environment that run `python -m module args_path` as `processes` ranks on this machine.

    One node, a rendezvous on a free port of the bind address (what `torchrun --standalone` does on localhost, but
    with every store bound to that address only).
    """
    environ = dict(os.environ if environ is None else environ)
    address = bind_address(environ)
    command = [
        sys.executable, "-m", "eyrie.core.torchrun",
        "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:0", "--master-addr", address,
        "--nproc_per_node", str(processes), "-m", module, str(args_path),
    ]
    return command, {**environ, **DISTRIBUTED_ENV, **loopback_sockets(address, environ), BIND_ENV: address}


def loopback_sockets(address: str, environ: dict) -> dict:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME = lo where the ranks meet on loopback (Linux), unless the user set them:
    the ranks' own gloo and NCCL sockets otherwise take the interface the host name resolves to, which may face out."""
    import ipaddress

    try:
        loopback = address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name the user gave: its interface is theirs to choose
        loopback = False
    if not loopback or not sys.platform.startswith("linux"):
        return {}
    return {name: "lo" for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in environ}


def run_ranks(module: str, kwargs: dict, processes: int, args_path: str | Path) -> int:
    """`module args_path` as `processes` ranks under torchrun (`torchrun_command`); returns its exit code.

    kwargs go to args_path as JSON (kept, so a failed launch can be rerun by hand). The ranks' output is
    copied to this process's stderr as it comes, so a job log that tees stderr holds it in order. torchrun
    stops every rank as soon as one fails, so none waits forever in a collective.
    """
    import codecs
    import subprocess

    args_path = Path(args_path)
    args_path.parent.mkdir(parents=True, exist_ok=True)
    args_path.write_text(json.dumps(kwargs, indent=1, default=str))
    command, env = torchrun_command(module, args_path, processes)
    ranks = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may end inside a progress bar's block character
    for chunk in iter(lambda: ranks.stdout.read1(1 << 16), b""):  # as it comes: progress bars end lines with \r
        sys.stderr.write(text.decode(chunk))
    sys.stderr.write(text.decode(b"", final=True))
    return ranks.wait()


def bind_stores_to(address: str) -> None:
    """Make every TCP store this process hosts listen on `address` only: each gets a socket bound there
    (TCPStore's master_listen_fd) instead of binding every interface itself."""
    import socket

    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend

    real = dist.TCPStore
    sockets = []  # kept open for the life of the process: the stores listen on them

    def store(host_name, port=None, *args, **kwargs):
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and kwargs.get("master_listen_fd") is None:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port or 0))
            sock.listen(4096)
            sockets.append(sock)
            port = sock.getsockname()[1]
            kwargs["master_listen_fd"] = sock.fileno()
        return real(host_name, port, *args, **kwargs)

    dist.TCPStore = store  # torchrun's agent calls dist.TCPStore ...
    c10d_backend.TCPStore = store  # ... and the c10d rendezvous its own import of it


def main() -> None:
    """`python -m eyrie.core.torchrun TORCHRUN-ARGS`: torchrun with its stores bound to EYRIE_TORCHRUN_BIND."""
    bind_stores_to(os.environ.get(BIND_ENV) or LOOPBACK)
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
