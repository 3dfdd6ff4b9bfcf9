"""Expert-parallel groups: the torch.distributed process groups lynx calls run over, named by small
integers so that the custom ops take plain arguments (a traced graph holds no Python objects).

Lifetime: other ranks read a rank's workspace during their passes, and a rank cannot tell from its
own calls when they are done, so a workspace of a group is never freed while the process runs
(their tags are ops' per-stream ones, which no layer releases). At exit, each process waits for its device and meets the group's
other ranks at a barrier before its buffers go, so that none is freed while another rank's kernel
may still read it."""

import atexit
import datetime
import sys

import torch
import torch.distributed as dist

_BY_ID: dict = {0: None}  # id -> (group, peer_timeout_ms); 0: no expert parallelism
_IDS: dict = {}  # (id(group), peer_timeout_ms) -> id


def group_id(group, peer_timeout_ms: int = 0) -> int:
    """The id of `group` with this cross-rank timeout (None, or a group of one rank: 0). The registry
    keeps the group alive."""
    if group is None:
        return 0
    if not dist.is_initialized():
        raise ValueError("lynx: ep_group: torch.distributed is not initialised")
    if dist.get_rank(group) < 0:
        raise ValueError("lynx: ep_group: this process is not a member of the group")
    if dist.get_world_size(group) == 1:
        return 0
    if peer_timeout_ms < 0:
        raise ValueError(f"lynx: config.peer_timeout_ms: must be >= 0, got {peer_timeout_ms}")
    key = (id(group), peer_timeout_ms)
    gid = _IDS.get(key)
    if gid is None:
        # NOTES: the id holds the group's size (R < 256): the fake kernels size a forward's context from
        # R, and torch.compile's caches (on disk too, across processes) key on the ops' arguments, so a
        # graph compiled for one group size must not be found for another with the same small id.
        gid = len(_BY_ID) * 256 + dist.get_world_size(group)
        _BY_ID[gid] = (group, peer_timeout_ms)
        _IDS[key] = gid
    return gid


def ranks(gid: int) -> tuple[int, int]:
    """(R, this process's rank in the group)."""
    if gid == 0:
        return 1, 0
    group = _BY_ID[gid][0]
    return dist.get_world_size(group), dist.get_rank(group)


def peer_timeout_ms(gid: int) -> int:
    return 0 if gid == 0 else _BY_ID[gid][1]


def all_gather(gid: int):
    """bytes -> [every rank's bytes, in rank order] over the group (how lynx::connect_process_group
    exchanges the CUDA IPC handles of the ranks' workspaces)."""
    group = _BY_ID[gid][0]

    def gather(mine: bytes) -> list:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, mine, group=group)
        return out

    return gather


_CONNECTED: set = set()  # ids of groups with a connected workspace in this process


def connected(gid: int) -> None:
    _CONNECTED.add(gid)


_EXIT_BARRIER = datetime.timedelta(seconds=60)


@atexit.register
def _meet_before_exit():
    # NOTES: a process that destroyed its process group first (dist.destroy_process_group, after its
    # own barrier) has nothing left to meet here, and one leaving on an unhandled exception must not
    # wait for ranks that are in another collective: it leaves at once, as it would without lynx. The
    # barriers are bounded, and met in the same order on every rank (by the groups' member lists).
    if not _CONNECTED or not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    groups = {id(_BY_ID[g][0]): _BY_ID[g][0] for g in _CONNECTED}.values()
    try:
        torch.cuda.synchronize()
        for group in sorted(groups, key=dist.get_process_group_ranks):
            dist.barrier(group=group, async_op=True).wait(timeout=_EXIT_BARRIER)
    except Exception:  # a rank that is already gone, or one that did not come in time
        pass
