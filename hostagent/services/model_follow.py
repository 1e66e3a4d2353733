"""The running agent follows the usage store's active placement model.

A model trained with `hostagent model train`, rolled back with `hostagent model rollback`, promoted by another
agent's retraining on a shared store, or deactivated, takes effect here within `placement.model_check_interval_s`:
`ModelFollower.check` reads the active version's metadata (never the artifact) and, only when it differs from the
version this agent follows, loads that version's artifact in a worker thread (scikit-learn's import and the skops
load never run on the event loop) and switches the placer. No active model any more: back to the cold-start rule.

Every switch is journaled (`model-change`: from which version to which, and why) and kept, newest last, in a
bounded history (`changes`) that the dashboard's placement page shows. A version whose artifact cannot be loaded
is remembered (`failed`), warned about once (and journaled once, `model-load-failed`) and not tried again: the
model in use stays. A store that cannot be read is tried again at the next check, and said once per outage.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hostagent.domain.errors import HostAgentError, InvalidInput, NotFound, StoreUnavailable
from hostagent.learn import MODEL_KIND

log = logging.getLogger("hostagent.placement")

CHANGE_KIND = "model-change"  # journal event: the placer switched models
FAILED_KIND = "model-load-failed"  # journal event: the store's active version could not be loaded (once per version)
HISTORY_MAX = 50  # switches kept for the dashboard
COLD_START = "none (cold-start rule)"

# How a switch came about (ModelChange.how), and the words the journal and the placement page use for it.
START, RETRAIN, GROWN, TRAINED, ROLLED_BACK, DEACTIVATED = (
    "start", "retrain", "grown", "trained", "rolled back", "deactivated")
WHY = {
    START: "the store's active model when the agent started",
    RETRAIN: "this agent's scheduled retraining promoted it",
    GROWN: "this agent's retraining promoted it as its records grew (placement.retrain_growth)",
    TRAINED: "followed the store: a newer model was trained and activated (hostagent model train, or another "
             "agent's retraining)",
    ROLLED_BACK: "followed the store: an older version was activated again (hostagent model rollback)",
    DEACTIVATED: "followed the store: no model is active any more (deactivated or removed), the cold-start rule "
                 "decides",
}


@dataclass(frozen=True, slots=True)
class ModelChange:
    """One switch of the placer's model."""

    at: float
    before: str | None  # the version in use before (None: the cold-start rule)
    after: str | None  # the version in use after
    how: str  # START | RETRAIN | GROWN | TRAINED | ROLLED_BACK | DEACTIVATED

    @property
    def why(self) -> str:
        """The switch in words."""
        return WHY[self.how]

    def say(self) -> str:
        """The journal event's detail."""
        return f"placement model {self.before or COLD_START} -> {self.after or COLD_START}: {self.why}"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the dashboard's)."""
        return {"at": self.at, "from": self.before, "to": self.after, "how": self.how, "why": self.why}


def load_version(registry: Any, version: str) -> Any:
    """The learned scorer of one stored version (worker thread: imports scikit-learn on first use)."""
    model = importlib.import_module("hostagent.learn.model")
    row = registry.get_model_version(version, kind=MODEL_KIND, with_artifact=True)
    if not row.get("artifact"):
        raise InvalidInput(f"model version {version} has no artifact in the store", field="artifact")
    return model.LearnedScorer(model.ModelBundle.from_bytes(bytes(row["artifact"])), name=version)


class ModelFollower:
    """Keeps the placer on the store's active placement model (see the module's docstring)."""

    def __init__(self, placer: Any, registry: Callable[[], Any], *, journal: Any,
                 clock: Callable[[], float] = time.time, after_switch: Callable[[], None] | None = None,
                 history: int = HISTORY_MAX) -> None:
        self.placer = placer
        self._registry = registry  # the usage store (opened after the runtime is built)
        self.journal = journal
        self.clock = clock
        self.after_switch = after_switch  # e.g. settle the heap once the old model is garbage
        self.changes: collections.deque[ModelChange] = collections.deque(maxlen=history)
        self.failed: dict[str, str] = {}  # version -> why its artifact could not be loaded (not tried again)
        self.checks = 0  # store checks made (the placement page and the tests read it)
        self.following: str | None = None  # the store's version this agent loaded (None: none)
        self._created: dict[str, float] = {}  # created_at of the versions followed: a rollback goes back in time
        self._unreadable: str | None = None  # the store's error while it stays unreadable (said once)
        self._lock = asyncio.Lock()  # the periodic check and the retraining's load never overlap

    async def check(self, how: str | None = None) -> bool:
        """Read the store's active version (metadata only); when it is not the one followed, load it and switch
        the placer (`how`: START, RETRAIN or GROWN when the caller knows why, else worked out). True when it
        switched."""
        async with self._lock:
            self.checks += 1
            try:
                row = await asyncio.to_thread(self._active_row)
            except HostAgentError as exc:
                self._unreadable_once(exc)
                return False
            version = None if row is None else str(row["version"])
            if version == self.following or (version is not None and version in self.failed):
                return False
            scorer = None
            if row is not None and version is not None:
                try:
                    scorer = await asyncio.to_thread(load_version, self._registry(), version)
                except (StoreUnavailable, NotFound) as exc:  # the store went away, or the version with it: next check
                    self._unreadable_once(exc)
                    return False
                except Exception as exc:  # noqa: BLE001 - a broken artifact: keep the current model
                    await self._failed(version, exc)
                    return False
                self._created[version] = float(row.get("created_at") or 0.0)
            change = ModelChange(self.clock(), self.placer.model_version, version, how or self._how(version))
            await self._journal(CHANGE_KIND, change.say())
            self.placer.use(scorer, version)
            self.following = version
            self.changes.append(change)
            log.info("%s", change.say())
            if self.after_switch is not None:
                self.after_switch()
            return True

    def _active_row(self) -> dict[str, Any] | None:
        row: dict[str, Any] | None
        try:
            row = self._registry().get_model_version(None, kind=MODEL_KIND, with_artifact=False)
        except NotFound:
            row = None
        if self._unreadable is not None:
            log.info("the usage store answers the model check again")
            self._unreadable = None
        return row

    def _how(self, version: str | None) -> str:
        if version is None:
            return DEACTIVATED
        created = self._created[version]
        return ROLLED_BACK if any(t > created for v, t in self._created.items() if v != version) else TRAINED

    def _unreadable_once(self, exc: HostAgentError) -> None:
        if self._unreadable is None:
            log.warning("cannot read the store's active placement model: %s; keeping %s (tried again every check)",
                        exc.message, self.placer.model_version or COLD_START)
        self._unreadable = exc.message

    async def _failed(self, version: str, exc: Exception) -> None:
        why = (exc.message if isinstance(exc, HostAgentError) else f"{type(exc).__name__}: {exc}")[:500]
        self.failed[version] = why
        keep = self.placer.model_version or COLD_START
        log.warning("cannot load placement model %s: %s; keeping %s", version, why, keep)
        await self._journal(FAILED_KIND, f"placement model {version} could not be loaded ({why}); kept {keep}")

    async def _journal(self, kind: str, detail: str) -> None:
        try:
            await asyncio.to_thread(self.journal.event, kind, actor="agent", detail=detail[:1000])
        except Exception:  # noqa: BLE001 - the switch still happens; the log says it
            log.exception("could not journal %s", kind)


__all__ = ["CHANGE_KIND", "FAILED_KIND", "ModelChange", "ModelFollower", "load_version"]
