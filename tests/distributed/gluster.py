"""A real GlusterFS volume on this one machine, with two FUSE mounts standing in for two nodes.

Layout (every piece private to one `Cluster`, so two of them, say two pytest-xdist workers, run
side by side, and nothing is left behind):

- network namespace `<name>-s` ("the storage server"): glusterd and its brick daemons, reached at
  10.213.0.1 (on its loopback); glusterd's state, run and log directories are a temporary
  directory's (bind-mounted over /var/lib/glusterd, /run/gluster and /var/log/glusterfs in
  glusterd's own mount namespace), so a system glusterd, if any, is never touched;
- a distributed volume over `bricks` directories of the same temporary directory;
- one network namespace per node (`<name>-a`, `<name>-b`) joined to the server's by a veth pair
  (10.213.<n>.2 -> 10.213.<n>.1): the node's FUSE client (`glusterfs`) runs there, its mount is
  in this machine's mount namespace, so every process here reads the volume through it; cutting
  a node's link (`cut`) leaves its mount in place with its server out of reach, as a network
  partition would.

Needs root, /dev/fuse, the Debian packages glusterfs-server and glusterfs-client (scripts/setup.sh
installs them), iproute2's `ip` and util-linux's `nsenter`. `missing()` names what is absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SERVER_IP = "10.213.0.1"
VOLUME = "tutti"
TOOLS = ("glusterd", "gluster", "glusterfs", "mount.glusterfs", "ip", "nsenter", "mount", "umount")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
#: How long a client waits for a brick that stopped answering before it fails the call (Gluster's
#: default is 42 s; the fault tests cut links on purpose).
PING_TIMEOUT_S = 5


def which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def missing() -> list[str]:
    """What this machine lacks to bring a volume up: [] when nothing."""
    out = []
    if os.geteuid() != 0:
        out.append("root (glusterd, mount and network namespaces need it)")
    if not os.path.exists("/dev/fuse"):
        out.append("/dev/fuse (FUSE)")
    tools = [t for t in TOOLS if which(t) is None]
    if tools:
        out.append("the commands " + ", ".join(tools) + " (Debian: apt-get install glusterfs-server glusterfs-client"
                   " iproute2 util-linux; scripts/setup.sh does it)")
    return out


def _run(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit status {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}")
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_list() -> list[str]:
    p = _run("ip", "netns", "list", check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process of `ns`, then delete it."""
    for _ in range(50):
        pids = [int(x) for x in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _run("ip", "netns", "delete", ns, check=False)


def _mounts_under(path: str) -> list[str]:
    with open("/proc/mounts", encoding="utf-8") as f:
        mnts = [ln.split()[1].replace("\\040", " ") for ln in f]
    return [m for m in mnts if m == path or m.startswith(path.rstrip("/") + "/")]


def clean_stale(prefix: str = "tutti-gl-") -> None:
    """Remove what a Cluster of a process that no longer runs left (killed before its teardown)."""
    for ns in netns_list():
        if not ns.startswith(prefix):
            continue
        try:
            pid = int(ns[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            _kill_netns(ns)


class Cluster:
    """GlusterFS up on this machine: `mounts[node]` is that node's mount of the one volume."""

    def __init__(self, base: str | os.PathLike, *, nodes: tuple[str, ...] = ("a", "b"), bricks: int = 2,
                 name: str | None = None, brick_bytes: int | None = None) -> None:
        """`brick_bytes`: each brick a tmpfs of that size (a volume that fills up), else a
        directory of `base`'s file system."""
        self.base = Path(base)
        self.name = name or f"tutti-gl-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.nodes = nodes
        self.server_ns = f"{self.name}-s"
        self.node_ns = {n: f"{self.name}-{n}" for n in nodes}
        self.state, self.run_dir, self.logs = self.base / "state", self.base / "run", self.base / "log"
        self.brick_dirs = [self.base / f"brick{i}" for i in range(bricks)]
        self.mounts = {n: self.base / f"node-{n}" for n in nodes}
        self.sock = self.run_dir / "glusterd.socket"
        self.brick_bytes = brick_bytes
        self.bringup_s: dict[str, float] = {}
        self._up = False

    # -- bring-up ------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        clean_stale()
        t0 = time.perf_counter()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.bringup_s["total"] = time.perf_counter() - t0
        return self

    def _start(self) -> None:
        for d in (self.state, self.run_dir, self.logs, *self.brick_dirs, *self.mounts.values()):
            d.mkdir(parents=True, exist_ok=True)
        self._up = True
        if self.brick_bytes:
            for d in self.brick_dirs:
                _run("mount", "-t", "tmpfs", "-o", f"size={self.brick_bytes},mode=0755", "tmpfs", str(d))
        t = time.perf_counter()
        s = self.server_ns
        _run("ip", "netns", "add", s)
        _run("ip", "-n", s, "link", "set", "lo", "up")
        _run("ip", "-n", s, "addr", "add", f"{SERVER_IP}/32", "dev", "lo")
        for i, (node, ns) in enumerate(self.node_ns.items(), start=1):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", s, "link", "add", f"v{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", s, "addr", "add", f"10.213.{i}.1/30", "dev", f"v{node}")
            _run("ip", "-n", ns, "addr", "add", f"10.213.{i}.2/30", "dev", "eth0")
            _run("ip", "-n", s, "link", "set", f"v{node}", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "route", "add", f"{SERVER_IP}/32", "via", f"10.213.{i}.1")
        self.bringup_s["network"] = time.perf_counter() - t

        t = time.perf_counter()
        vol = self.base / "glusterd.vol"
        vol.write_text(
            "volume management\n    type mgmt/glusterd\n"
            f"    option working-directory {self.state}\n"
            f"    option run-directory {self.run_dir}\n"
            f"    option glusterd-sockfile {self.sock}\n"
            "    option transport-type socket\n    option transport.socket.listen-port 24007\n"
            "    option ping-timeout 0\n    option event-threads 1\n    option max-port 60999\nend-volume\n")
        # glusterd's own mount namespace (ip netns exec makes one): the paths it and its bricks
        # write outside the working directory (brick sockets, logs) land in ours
        binds = " && ".join(f"mkdir -p {host} && mount --bind {mine} {host}" for mine, host in (
            (self.run_dir, "/run/gluster"), (self.logs, "/var/log/glusterfs"), (self.state, "/var/lib/glusterd")))
        _run("ip", "netns", "exec", s, "sh", "-c",
             f"{binds} && exec {which('glusterd')} -f {vol} -p {self.run_dir / 'glusterd.pid'} "
             f"-l {self.logs / 'glusterd.log'}")
        deadline = time.monotonic() + 30
        while self.gluster("volume", "list", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"glusterd did not answer within 30 s: {self._log_tail('glusterd.log')}")
            time.sleep(0.05)
        self.bringup_s["glusterd"] = time.perf_counter() - t

        t = time.perf_counter()
        self.gluster("volume", "create", VOLUME, *(f"{SERVER_IP}:{b}" for b in self.brick_dirs), "force")
        self.gluster("volume", "set", VOLUME, "network.ping-timeout", str(PING_TIMEOUT_S))
        self.gluster("volume", "start", VOLUME)
        self.bringup_s["volume"] = time.perf_counter() - t

        t = time.perf_counter()
        for node in self.nodes:
            self.mount(node)
        self.bringup_s["mounts"] = time.perf_counter() - t

    def gluster(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """The gluster CLI against this cluster's glusterd (through its socket file)."""
        return _run(which("gluster"), f"--glusterd-sock={self.sock}", f"--log-file={self.logs / 'cli.log'}",
                    "--mode=script", *args, timeout=120, check=check)

    def mount(self, node: str) -> Path:
        """Mount the volume at `mounts[node]`, its client in the node's network namespace."""
        mnt = self.mounts[node]
        _run("nsenter", f"--net=/run/netns/{self.node_ns[node]}", "mount", "-t", "glusterfs",
             "-o", f"log-file={self.logs / f'client-{node}.log'}", f"{SERVER_IP}:/{VOLUME}", str(mnt))
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt) or fs_type_of(mnt) != "fuse.glusterfs":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mnt}: not mounted after 20 s: {self._log_tail(f'client-{node}.log')}")
            time.sleep(0.05)
        return mnt

    # -- faults --------------------------------------------------------------------------------
    def client_pids(self, node: str) -> list[int]:
        return [int(x) for x in _run("ip", "netns", "pids", self.node_ns[node], check=False).stdout.split()]

    def cut(self, node: str) -> None:
        """The node's link to the storage server goes down (its mount stays)."""
        _run("ip", "-n", self.server_ns, "link", "set", f"v{node}", "down")

    def restore(self, node: str) -> None:
        _run("ip", "-n", self.server_ns, "link", "set", f"v{node}", "up")

    def kill_client(self, node: str) -> None:
        """kill -9 the node's FUSE client: its mount answers ENOTCONN from then on."""
        for pid in self.client_pids(node):
            os.kill(pid, signal.SIGKILL)

    def unmount(self, node: str, lazy: bool = True) -> None:
        mnt = str(self.mounts[node])
        if os.path.ismount(mnt) or _mounts_under(mnt):
            _run("umount", *(["-l"] if lazy else []), mnt, check=False)
        for pid in self.client_pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- teardown ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Everything removed: mounts, client, brick and glusterd processes, namespaces, files."""
        if not self._up:
            return
        t = time.perf_counter()
        for node in self.nodes:
            self.unmount(node)
        for ns in [*self.node_ns.values(), self.server_ns]:
            _kill_netns(ns)
        for mnt in sorted(_mounts_under(str(self.base)), reverse=True):  # the bricks' tmpfs, if any
            _run("umount", "-l", mnt, check=False)
        shutil.rmtree(self.base, ignore_errors=True)
        self._up = False
        self.bringup_s["teardown"] = time.perf_counter() - t

    def _log_tail(self, name: str, n: int = 4000) -> str:
        try:
            return (self.logs / name).read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def fs_type_of(path: str | os.PathLike) -> str:
    """The type /proc/mounts gives the mount at `path` exactly ("" when none is)."""
    p = os.path.realpath(path)
    kind = ""
    with open("/proc/mounts", encoding="utf-8") as f:
        for ln in f:
            parts = ln.split()
            if len(parts) >= 3 and parts[1].replace("\\040", " ") == p:
                kind = parts[2]
    return kind
