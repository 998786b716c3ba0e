"""A small cluster of hosts on this machine, for tests across hosts: network and UTS namespaces on a bridge.

Each host is a network namespace whose one link, ``eth0``, goes to a bridge
in a namespace of its own (the switch), with an address of 198.18.0.0/15
(the benchmarking range, never routed) and its name as hostname:
``Cluster.on(host, command)`` is ``command`` run on that host. The root
namespace is not touched. ``Cluster`` is a context manager: leaving it
removes every namespace, and with them their links, also when the test
failed; names carry this process's id, so that runs side by side do not meet.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from types import TracebackType

NETWORK = "198.18.0"  # /24 of 198.18.0.0/15


@dataclass(frozen=True)
class Host:
    name: str  # its hostname
    address: str
    namespace: str
    port: str  # its link's end on the switch


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Cluster:
    def __init__(self, size: int) -> None:
        prefix = f"mdl{os.getpid()}"
        self.switch = f"{prefix}sw"
        self.hosts = [Host(f"node{i}", f"{NETWORK}.{i}", f"{prefix}n{i}", f"p{i}") for i in range(1, size + 1)]

    def __enter__(self) -> Cluster:
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                ip("netns", "add", host.namespace)
                ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "eth0", "netns", host.namespace)
                ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
                ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
                ip("-n", host.namespace, "link", "set", "eth0", "up")
                ip("-n", host.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        """Remove every namespace this cluster made (their links go with them), whatever exists of it."""
        for namespace in [host.namespace for host in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)

    def on(self, host: Host, command: list[str]) -> list[str]:
        """``command`` run on ``host``: in its network namespace, under its hostname. Through ``nsenter``, not
        ``ip netns exec``, which mounts a /sys of its own without the cgroup tree that slurmd needs."""
        return [
            "nsenter", f"--net=/run/netns/{host.namespace}",
            "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *command,
        ]  # fmt: skip

    def partition(self, host: Host) -> None:
        """Cut ``host`` off the network (its port on the switch down), its processes left running."""
        ip("-n", self.switch, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        ip("-n", self.switch, "link", "set", host.port, "up")

    def lose(self, host: Host) -> None:
        """The host dies: cut off, then every process on it killed (its daemons and jobs with them)."""
        self.partition(host)
        listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=30)
        for pid in listed.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def namespaces(self) -> set[str]:
        """This cluster's namespaces that exist now."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        ours = {host.namespace for host in self.hosts} | {self.switch}
        return {line.split()[0] for line in listed.splitlines() if line.split() and line.split()[0] in ours}
