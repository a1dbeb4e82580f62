"""The rollout lease: one holder per channel at a time, behind one small interface (ChannelLease).

Two kinds, chosen by release.yaml:
- RegistryLease (the default): a `lease-<channel>` tag of the state repository. A registry has no
  compare-and-swap, so acquiring is read, write, wait a settle delay, read back (README, "The lease
  and what it guarantees", says what that leaves open);
- KubernetesLease (`lease: {kubeconfig, namespace}`): a coordination.k8s.io/v1 Lease per channel in
  that cluster. The API server's resourceVersion is the compare-and-swap: a lease is created (POST;
  409 AlreadyExists: someone else was first), taken over and renewed only by a PUT carrying the
  resourceVersion it read (409 Conflict: someone else wrote it in between), released by a DELETE
  with the resourceVersion and uid as preconditions. Two rollouts can never both hold a channel.

Both decide the same way whether a lease read back still holds the channel (HolderPolicy): not when
it expired, nor when its holder was this same rollout in a process of this host that is gone, nor
when its rollout's record says it finished. Anything read back is untrusted: a lease that cannot be
read holds the channel, and the message says what is wrong with it and how to clear it.
"""
from __future__ import annotations

import math
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from imagebuild.config.release_file import LeaseCluster, ReleaseConfig
from imagebuild.core.source import safe_text
from imagebuild.kube.client import KubeClient, KubeConflict, KubeError
from imagebuild.kube.config import load_kubeconfig
from imagebuild.kube.leases import Lease, LeaseDocumentError, lease_body, lease_name
from imagebuild.oci.client import RegistryError
from imagebuild.oci.retry import RetryingTransport, RetryPolicy
from imagebuild.rollout.plan import ROLLOUT_ID_PATTERN
from imagebuild.rollout.state import (
    FINISHED,
    LEASE_TYPE,
    RECORD_TYPE,
    LeaseHeld,
    RolloutError,
    StateRefused,
    StateStore,
    now_iso,
    record_tag,
    state_tag,
    who,
)

# The API server answers in milliseconds; a blip (429 under its priority and fairness, a 503 while it
# restarts) is retried briefly. A retried write that had landed is recognised by the lease's nonce.
KUBE_RETRIES = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0, max_elapsed_s=5.0, max_retry_after_s=5.0)
ANNOTATION = "rollout.imagebuild.org/"
_HOLDER = re.compile(r"([a-z0-9][a-z0-9-]{0,80})/([0-9a-f]{16})")  # <rollout ID>/<nonce>, as this module writes it


class ChannelLease(Protocol):
    """What the reconciler needs of a lease: take it for all its channels, keep it, let it go."""

    channels: tuple[str, ...]

    def acquire(self) -> None:
        """Hold every channel, or none and LeaseHeld (exit 4) naming the holder."""

    def renew(self, force: bool = False) -> None:
        """Before every step: still ours (else LeaseHeld); extended once a third of its time is used."""

    def release(self) -> None:
        """Let go of what is ours; never raises (an unreleased lease expires on its own)."""

    def holder(self) -> dict[str, Any] | None:
        """Who holds the first channel now (rollout, user, host, expires_at), for `rollout status`."""

    def close(self) -> None:
        """Close connections."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class HolderPolicy:
    """Whether a lease read back (as a dict: rollout, nonce, host, pid, user, expires_at) holds a channel against
    rollout `rollout_id` (process nonce `nonce`), and how to say who holds it."""

    store: StateStore
    rollout_id: str
    nonce: str

    def mine(self, held: Mapping[str, Any] | None) -> bool:
        return held is not None and held.get("nonce") == self.nonce

    def blocking(self, held: Mapping[str, Any] | None, now: float) -> bool:
        if not held or self.mine(held):
            return False
        # A lease is untrusted input too: one that cannot be read holds the channel (say so, do not crash).
        expires, pid, rollout = held.get("expires_at"), held.get("pid"), held.get("rollout")
        if not isinstance(expires, (int, float)) or isinstance(expires, bool):
            return True
        if expires <= now:
            return False  # expired: its holder crashed or hung; recoverable by design
        # The same rollout, left behind by a process of ours that is gone (killed): take it over.
        if (rollout == self.rollout_id and held.get("host") == socket.gethostname()
                and isinstance(pid, int) and pid > 0 and not _pid_alive(pid)):
            return False
        if not isinstance(rollout, str) or not ROLLOUT_ID_PATTERN.fullmatch(rollout) or rollout == self.rollout_id:
            return True
        # A rollout that finished (killed between recording its end and releasing the lease) holds nothing.
        try:
            record = self.store.read(record_tag(rollout), RECORD_TYPE)
        except StateRefused:
            return True
        return not (record and record.get("status") in FINISHED)

    @staticmethod
    def describe(held: Mapping[str, Any], now: float) -> str:
        if held.get("problem"):
            return f"an unreadable lease holds it ({held['problem']}); delete it if no rollout runs"
        expires = held.get("expires_at")
        if not isinstance(expires, (int, float)) or isinstance(expires, bool):
            return f"an unreadable lease (expires_at {safe_text(expires, 100)}) holds it; delete it if no rollout runs"
        left = expires - now
        if held.get("foreign") is not None:
            return f"holder '{safe_text(held['foreign'], 100)}' (not an imagebuild rollout) holds it for another " \
                   f"{max(left, 0):.0f}s"
        names = {key: safe_text(held.get(key), 64) for key in ("rollout", "user", "host", "pid")}
        return (f"rollout {names['rollout']} (user {names['user']} on {names['host']}, pid {names['pid']}) "
                f"holds it for another {max(left, 0):.0f}s")


def _mine_fields(rollout_id: str, nonce: str, now: float, ttl_s: float) -> dict[str, Any]:
    return {"rollout": rollout_id, "nonce": nonce, "host": socket.gethostname(), "pid": os.getpid(),
            "user": who()["user"], "acquired_at": now_iso(now), "expires_at": now + ttl_s}


@dataclass
class RegistryLease:
    """One lease tag per channel; held by one rollout (and process) until it expires.

    The registry offers no compare-and-swap, so acquiring is read, write ours, wait `settle_s`,
    read back: of two writers racing, the later write wins and the earlier sees it on reading
    back. See README `## Rollout` for what this does and does not guarantee.
    """

    store: StateStore
    channels: tuple[str, ...]
    rollout_id: str
    ttl_s: float
    settle_s: float
    sleep: Callable[[float], None]  # the settle wait (the reconciler's Timing.sleep)
    clock: Callable[[], float]  # wall-clock seconds: expires_at is compared across processes
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    renewed_at: float = 0.0

    @property
    def policy(self) -> HolderPolicy:
        return HolderPolicy(self.store, self.rollout_id, self.nonce)

    @property
    def tags(self) -> list[str]:
        return [state_tag("lease", channel) for channel in sorted(self.channels)]

    def _mine(self, now: float) -> dict[str, Any]:
        return _mine_fields(self.rollout_id, self.nonce, now, self.ttl_s)

    def _read(self, tag: str) -> dict[str, Any] | None:
        return self.store.read(tag, LEASE_TYPE)

    def acquire(self) -> None:
        now = self.clock()
        policy = self.policy
        for tag, channel in zip(self.tags, sorted(self.channels)):
            held = self._read(tag)
            if policy.blocking(held, now):
                assert held is not None
                raise LeaseHeld(f"channel '{channel}' is being rolled out: {policy.describe(held, now)}")
        mine = self._mine(now)
        for tag in self.tags:
            self.store.write(tag, mine, LEASE_TYPE)
        self.sleep(self.settle_s)
        for tag, channel in zip(self.tags, sorted(self.channels)):
            held = self._read(tag)
            if not policy.mine(held):
                self._release_mine()
                other = policy.describe(held, self.clock()) if held else "its lease vanished"
                raise LeaseHeld(f"channel '{channel}': another rollout took the lease at the same time: {other}")
        self.renewed_at = now

    def renew(self, force: bool = False) -> None:
        now = self.clock()
        policy = self.policy
        for tag, channel in zip(self.tags, sorted(self.channels)):
            held = self._read(tag)
            if not policy.mine(held):
                other = policy.describe(held, now) if held else "the lease is gone"
                raise LeaseHeld(f"lost the lease of channel '{channel}': {other}")
        if not force and now - self.renewed_at < self.ttl_s / 3:
            return
        mine = self._mine(now)
        for tag in self.tags:
            self.store.write(tag, mine, LEASE_TYPE)
        self.renewed_at = now

    def _release_mine(self) -> None:
        for tag in self.tags:
            held = self._read(tag)
            if self.policy.mine(held):
                self.store.delete(tag)

    def release(self) -> None:
        try:
            self._release_mine()
        except (RegistryError, StateRefused):
            pass  # it expires on its own

    def holder(self) -> dict[str, Any] | None:
        try:
            held = self._read(self.tags[0])
        except StateRefused:
            return None  # shown as no lease; acting on the channel refuses it with the reason
        return {k: held.get(k) for k in ("rollout", "user", "host", "expires_at")} if held else None

    def close(self) -> None:
        """The store's registry is the caller's to close."""


# --- a Lease in a Kubernetes cluster ------------------------------------------------------------


def holding(lease: Lease | None) -> dict[str, Any] | None:
    """A Lease read back, as HolderPolicy reads a holder: None when nobody holds it (no object, or no
    holderIdentity: released); `foreign` for a holder this module did not write."""
    if lease is None or lease.holder is None:
        return None
    found: dict[str, Any] = {"expires_at": lease.expires_at}
    if lease.expires_at is None:
        missing = "spec.renewTime" if lease.renew_time is None else "spec.leaseDurationSeconds"
        found["problem"] = f"lease {lease.namespace}/{lease.name} has a holder but no {missing}"
    match = _HOLDER.fullmatch(lease.holder)
    if match is None:
        found["foreign"] = lease.holder
        return found
    pid = lease.annotations.get(ANNOTATION + "pid", "")
    found.update(rollout=match.group(1), nonce=match.group(2), host=lease.annotations.get(ANNOTATION + "host"),
                 user=lease.annotations.get(ANNOTATION + "user"),
                 pid=int(pid) if pid.isdigit() and len(pid) <= 10 else None)
    return found


@dataclass
class KubernetesLease:
    """One coordination.k8s.io/v1 Lease per channel, every write a compare-and-swap on its resourceVersion."""

    client: KubeClient
    namespace: str
    store: StateStore
    channels: tuple[str, ...]
    rollout_id: str
    ttl_s: float
    clock: Callable[[], float]  # wall-clock seconds: renewTime is written and compared across processes
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    renewed_at: float = 0.0
    held: dict[str, Lease] = field(default_factory=dict)  # channel -> our lease as last written

    @property
    def identity(self) -> str:
        return f"{self.rollout_id}/{self.nonce}"

    @property
    def policy(self) -> HolderPolicy:
        return HolderPolicy(self.store, self.rollout_id, self.nonce)

    @contextmanager
    def _speaking(self, channel: str) -> Iterator[None]:
        """A failure to talk to the cluster, or a lease document that cannot be read, said as a rollout error."""
        try:
            yield
        except LeaseDocumentError as exc:
            raise LeaseHeld(f"channel '{channel}': an unreadable lease holds it ({exc}); delete it if no rollout "
                            f"runs (kubectl -n {self.namespace} delete lease {lease_name(channel)})") from None
        except KubeConflict:
            raise
        except KubeError as exc:
            raise RolloutError(f"channel '{channel}': {exc}", exc.exit_code) from None

    def _body(self, channel: str, now: float, previous: Lease | None) -> dict[str, Any]:
        taking_over = previous is None or previous.holder != self.identity
        transitions = 0 if previous is None else previous.transitions + (1 if taking_over else 0)
        acquired = now if taking_over or previous is None or previous.acquire_time is None else previous.acquire_time
        mine = _mine_fields(self.rollout_id, self.nonce, now, self.ttl_s)
        annotations = {ANNOTATION + key: str(mine[key]) for key in ("host", "pid", "user")}
        return lease_body(self.namespace, lease_name(channel), holder=self.identity,
                          duration_s=max(1, math.ceil(self.ttl_s)), acquire_time=acquired, renew_time=now,
                          transitions=transitions, annotations=annotations,
                          resource_version=None if previous is None else previous.resource_version)

    def _read(self, channel: str) -> Lease | None:
        with self._speaking(channel):
            return self.client.get_lease(self.namespace, lease_name(channel))

    def _raced(self, channel: str) -> None:
        """After a 409: ours after all (a retried write that had landed), else LeaseHeld naming the winner."""
        now = self.clock()
        current = self._read(channel)
        held = holding(current)
        if self.policy.mine(held):
            assert current is not None
            self.held[channel] = current
            return
        other = self.policy.describe(held, now) if held else "its lease was released at the same time"
        raise LeaseHeld(f"channel '{channel}': another rollout took the lease at the same time: {other}")

    def _take(self, channel: str, now: float) -> None:
        current = self._read(channel)
        held = holding(current)
        if self.policy.blocking(held, now):
            assert held is not None
            raise LeaseHeld(f"channel '{channel}' is being rolled out: {self.policy.describe(held, now)}")
        try:
            with self._speaking(channel):
                if current is None:
                    self.held[channel] = self.client.create_lease(self._body(channel, now, None))
                else:
                    self.held[channel] = self.client.replace_lease(self._body(channel, now, current))
        except KubeConflict:
            self._raced(channel)

    def acquire(self) -> None:
        now = self.clock()
        try:
            for channel in sorted(self.channels):  # one order for every rollout: no two wait on each other
                self._take(channel, now)
        except BaseException:
            self.release()
            raise
        self.renewed_at = now

    def renew(self, force: bool = False) -> None:
        now = self.clock()
        current: dict[str, Lease] = {}
        for channel in sorted(self.channels):
            found = self._read(channel)
            held = holding(found)
            if not self.policy.mine(held):
                other = self.policy.describe(held, now) if held else "the lease is gone"
                raise LeaseHeld(f"lost the lease of channel '{channel}': {other}")
            assert found is not None
            current[channel] = found
        if not force and now - self.renewed_at < self.ttl_s / 3:
            return
        for channel, found in current.items():
            try:
                with self._speaking(channel):
                    self.held[channel] = self.client.replace_lease(self._body(channel, now, found))
            except KubeConflict:
                lost = holding(self._read(channel))
                if not self.policy.mine(lost):
                    other = self.policy.describe(lost, self.clock()) if lost else "the lease is gone"
                    raise LeaseHeld(f"lost the lease of channel '{channel}': {other}") from None
        self.renewed_at = now

    def release(self) -> None:
        for channel in sorted(self.channels):
            try:
                found = self.client.get_lease(self.namespace, lease_name(channel))
                if found is not None and self.policy.mine(holding(found)):
                    self.client.delete_lease(found)  # only if nobody wrote it since we read it
            except (KubeError, LeaseDocumentError):
                pass  # not ours any more, or unreachable: it expires on its own
            self.held.pop(channel, None)

    def holder(self) -> dict[str, Any] | None:
        channel = sorted(self.channels)[0]
        try:
            held = holding(self.client.get_lease(self.namespace, lease_name(channel)))
        except LeaseDocumentError:
            return None  # shown as no lease; acting on the channel refuses it with the reason
        except KubeError as exc:
            raise RolloutError(f"channel '{channel}': {exc}", exc.exit_code) from None
        if held is None:
            return None
        return {"rollout": held.get("rollout", held.get("foreign")), "user": held.get("user"),
                "host": held.get("host"), "expires_at": held.get("expires_at")}

    def close(self) -> None:
        self.client.close()


def kube_client(cluster: LeaseCluster) -> KubeClient:
    """The client for release.yaml's `lease:` cluster, its requests retried by oci.retry's engine."""
    access = load_kubeconfig(cluster.kubeconfig, cluster.context)

    def retried(transport: httpx.BaseTransport) -> httpx.BaseTransport:
        return RetryingTransport(transport, KUBE_RETRIES)

    try:
        return KubeClient(access, wrap=retried)
    except KubeError as exc:
        raise RolloutError(f"lease: {exc}", exc.exit_code) from None


def open_lease(config: ReleaseConfig, store: StateStore, channels: tuple[str, ...], rollout_id: str, *,
               settle_s: float, sleep: Callable[[float], None], clock: Callable[[], float]) -> ChannelLease:
    """The lease release.yaml asks for: a Kubernetes Lease with `lease:`, else the state repository's tag.
    `settle_s` and `sleep` are the registry lease's settle wait; `clock` is the lease's wall clock."""
    channels = tuple(dict.fromkeys(channels))
    if config.lease_cluster is not None:
        return KubernetesLease(kube_client(config.lease_cluster), config.lease_cluster.namespace, store, channels,
                               rollout_id, config.lease_ttl_s, clock)
    return RegistryLease(store, channels, rollout_id, config.lease_ttl_s, settle_s, sleep, clock)
