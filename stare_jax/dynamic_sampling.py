"""DAPO dynamic sampling: keep only groups whose rewards are not all equal.

A group whose G responses all got the same reward has zero advantage everywhere and contributes
no gradient; DAPO drops such groups and tops the batch up from further generation batches.
"""

from __future__ import annotations

import math

import numpy as np


class DynamicSamplingError(RuntimeError):
    """Too few groups with reward spread after the allowed number of generation batches."""


def groups_with_spread(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[num_groups] bool: True where max(r_g) > min(r_g) within the group (rewards group by group)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return r.max(axis=1) > r.min(axis=1)


class GroupBuffer:
    """Accumulates kept groups from successive generation batches until `target` groups are there.

    Each `add` takes a dict of arrays whose leading axis is responses (group by group) and a
    per-group keep mask; `take()` returns exactly `target` groups, in arrival order. Arrays named in
    `left_padded` may differ in width between generation batches (prompt buckets): `take()`
    left-pads the narrower ones with zeros (zero attention mask = padding) to the widest.
    """

    def __init__(self, target: int, group_size: int, *, left_padded: tuple[str, ...] = ()):
        self.target, self.group_size = target, group_size
        self.left_padded = tuple(left_padded)
        self._parts: list[dict[str, np.ndarray]] = []
        self.num_groups = 0
        self.seen_groups = 0

    def add(self, rows: dict[str, np.ndarray], keep_groups: np.ndarray) -> None:
        """Adds the groups of `rows` selected by `keep_groups` (bool [num_groups])."""
        keep_rows = np.repeat(np.asarray(keep_groups, bool), self.group_size)
        self.seen_groups += len(keep_groups)
        if keep_rows.any():
            self._parts.append({k: np.asarray(v)[keep_rows] for k, v in rows.items()})
            self.num_groups += int(np.sum(keep_groups))

    @property
    def full(self) -> bool:
        return self.num_groups >= self.target

    def take(self) -> dict[str, np.ndarray]:
        """The first `target` kept groups as one batch."""
        if not self.full:
            raise DynamicSamplingError(f"only {self.num_groups} of {self.target} groups kept")
        n = self.target * self.group_size
        out = {}
        for k in self._parts[0]:
            arrays = [p[k] for p in self._parts]
            if k in self.left_padded:
                width = max(a.shape[1] for a in arrays)
                arrays = [np.pad(a, [(0, 0), (width - a.shape[1], 0)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
            out[k] = np.concatenate(arrays)[:n]
        return out


def groups_to_generate(buffer: GroupBuffer, batch_groups: int) -> int:
    """Groups the next generation batch should generate: the missing ones divided by the fraction
    of groups kept so far in this step (at least one, at most the batch; the whole batch when none
    was kept yet)."""
    missing = buffer.target - buffer.num_groups
    if buffer.num_groups == 0 or buffer.seen_groups == 0:
        return batch_groups
    rate = buffer.num_groups / buffer.seen_groups
    return int(min(batch_groups, max(1, math.ceil(missing / rate))))
