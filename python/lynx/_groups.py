"""Expert-parallel groups: the torch.distributed process groups lynx calls run over, named by small
integers so that the custom ops take plain arguments (a traced graph holds no Python objects)."""

import torch.distributed as dist

_BY_ID: dict = {0: None}  # id -> group (0: no expert parallelism)
_IDS: dict = {}  # id(group) -> id


def group_id(group) -> int:
    """The id of `group` (None, or a group of one rank: 0). The group is kept alive by the registry."""
    if group is None:
        return 0
    if not dist.is_initialized():
        raise ValueError("lynx: ep_group: torch.distributed is not initialised")
    if dist.get_world_size(group) == 1:
        return 0
    gid = _IDS.get(id(group))
    if gid is None:
        gid = len(_BY_ID)
        _BY_ID[gid] = group
        _IDS[id(group)] = gid
    return gid


def ranks(gid: int) -> tuple[int, int]:
    """(R, this process's rank in the group)."""
    group = _BY_ID[gid]
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather(gid: int):
    """bytes -> [every rank's bytes, in rank order] over the group (how lynx::connect_process_group
    exchanges the CUDA IPC handles of the ranks' workspaces)."""
    group = _BY_ID[gid]

    def gather(mine: bytes) -> list:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, mine, group=group)
        return out

    return gather
