"""Emulated cluster links with network namespaces (needs root, iproute2 and tc).

N nodes ``gzn0 .. gzn{N-1}`` each get one veth end ``gzeth0`` with address
10.78.0.(i+1)/24; the other ends join a bridge that lives in its own namespace
``gznbr``. Nothing touches the root namespace and no namespace has a default
route, so traffic can only flow between the emulated nodes. A token bucket
(``tc tbf``) on both ends of each veth limits the node's transmit and receive to
the same rate: a full-duplex NIC of that rate behind a non-blocking switch.
(The approach follows the workplace's shared netsim.sh; names differ so both
can coexist.)
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

PREFIX = "10.78.0"
BRIDGE_NS = "gznbr"
BRIDGE = "gznbr0"
DEV = "gzeth0"


def node(i: int) -> str:
    return f"gzn{i}"


def address(i: int) -> str:
    return f"{PREFIX}.{i + 1}"


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def check() -> str | None:
    """Why this machine cannot emulate links, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (apt-get install -y iproute2)"
    return None


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in out if n.startswith("gzn")]


def _shape(ns: str, dev: str, rate: str | None, burst: str, latency: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate:
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )


def set_rate(n: int, rate: str | None, burst: str = "256kb", latency: str = "50ms") -> None:
    """Limit every node's TX and RX to ``rate`` (e.g. '100mbit'); None removes the limit."""
    for i in range(n):
        _shape(node(i), DEV, rate, burst, latency)
        _shape(BRIDGE_NS, f"gznv{i}", rate, burst, latency)


def up(n: int, rate: str | None = None) -> None:
    if namespaces():
        down()
    _run("ip", "netns", "add", BRIDGE_NS)
    _run("ip", "-n", BRIDGE_NS, "link", "set", "lo", "up")
    _run("ip", "-n", BRIDGE_NS, "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "-n", BRIDGE_NS, "link", "set", BRIDGE, "up")
    for i in range(n):
        ns = node(i)
        _run("ip", "netns", "add", ns)
        _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", BRIDGE_NS, "link", "add", f"gznv{i}", "type", "veth", "peer", "name", DEV, "netns", ns)
        _run("ip", "-n", BRIDGE_NS, "link", "set", f"gznv{i}", "master", BRIDGE)
        _run("ip", "-n", BRIDGE_NS, "link", "set", f"gznv{i}", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", DEV)
        _run("ip", "-n", ns, "link", "set", DEV, "up")
    set_rate(n, rate)


def down() -> None:
    for ns in namespaces():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def command(i: int, argv: list[str], env: dict[str, str]) -> list[str]:
    """argv run inside node i, with gloo bound to the node's interface."""
    assigns = [f"{k}={v}" for k, v in {**env, "GLOO_SOCKET_IFNAME": DEV}.items()]
    return ["ip", "netns", "exec", node(i), "env", *assigns, *argv]


# -- a namespace of its own holding only ``lo`` (link bytes read on its counters) ---------------
CLONE_NEWNET = 0x40000000


def lo_up(name: str) -> None:
    """Create namespace ``name`` with nothing but ``lo``, brought up."""
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, text=True)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True, text=True)


def lo_down(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def enter(name: str) -> None:
    """Move the calling process into namespace ``name`` (setns(2)); call it before any socket exists."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({name}): {os.strerror(e)}")
    finally:
        os.close(fd)


def read_lo() -> dict:
    """The calling process's namespace's ``lo`` TX counters."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                v = [int(x) for x in line.split(":", 1)[1].split()]
                return {"tx_bytes": v[8], "tx_packets": v[9]}
    raise RuntimeError("no lo in /proc/self/net/dev")
