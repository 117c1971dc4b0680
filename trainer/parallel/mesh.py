"""The 4-D device mesh (dp, pp, cp, tp) and the ParallelDims record the trainer passes around.

Rank order follows torchtitan: tp varies fastest, then cp, then pp, then dp, so the tp group of a
rank is a run of consecutive ranks (one node, fast links) and dp spans the farthest ranks.
"""
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model.torch_compat import flatten_mesh

MESH_DIMS = ("dp", "pp", "cp", "tp")
GROUP_NAMES = MESH_DIMS + ("dp_cp",)


def validate_layout(world_size, dp=None, tp=1, pp=1, cp=1):
    """Return (dp, None) for a valid layout, else (None, one line saying what to change).

    dp=None derives dp = world_size / (tp * pp * cp).
    """
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(size, int) or size < 1:
            return None, f"--{name} must be an integer >= 1, got {size}"
    model_parallel = tp * pp * cp
    if dp is None:
        if world_size % model_parallel != 0:
            return None, (f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
                          f"{model_parallel}; launch a multiple of {model_parallel} processes or change --tp/--pp/--cp")
        return world_size // model_parallel, None
    if not isinstance(dp, int) or dp < 1:
        return None, f"--dp must be an integer >= 1, got {dp}"
    if dp * model_parallel != world_size:
        return None, (f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * model_parallel} but world size is "
                      f"{world_size}; launch {dp * model_parallel} processes or change --dp/--tp/--pp/--cp")
    return dp, None


def _flatten_with_new_groups(mesh, dims, name):
    """Fallback for torch without DeviceMesh._flatten: one dist.new_group per flattened group."""
    keep = [MESH_DIMS.index(d) for d in dims]
    other = [i for i in range(len(MESH_DIMS)) if i not in keep]
    group_size = 1
    for i in keep:
        group_size *= mesh.mesh.shape[i]
    # Put the flattened dims last (in mesh order) so each row is one group's ranks.
    rows = mesh.mesh.permute(*other, *keep).reshape(-1, group_size)
    mine = None
    for row in rows.tolist():
        group = dist.new_group(row)  # every rank must create every group, in the same order
        if dist.get_rank() in row:
            mine = DeviceMesh.from_group(group, mesh.device_type, mesh=row, mesh_dim_names=(name,))
    return mine


def build_mesh(dp, pp, cp, tp, device_type):
    """init_device_mesh over (dp, pp, cp, tp); returns (world_mesh, dp_cp_mesh).

    dp_cp_mesh is the flattened dp x cp mesh over which gradients are reduced (= the dp mesh when cp=1).
    torch 2.11+ deprecates slicing a flattened dim from the root mesh, so keep the returned handle.
    """
    mesh = init_device_mesh(device_type, (dp, pp, cp, tp), mesh_dim_names=MESH_DIMS)
    dp_cp_mesh = flatten_mesh(mesh["dp", "cp"], "dp_cp")  # torchtitan's way (a private DeviceMesh method)
    if dp_cp_mesh is None:
        dp_cp_mesh = _flatten_with_new_groups(mesh, ("dp", "cp"), "dp_cp")
    return mesh, dp_cp_mesh


def group_ranks(mesh, dims):
    """Global ranks of this rank's group spanning `dims` (e.g. ("tp",) or ("dp", "cp")), from the mesh tensor."""
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    index = tuple(slice(None) if d in dims else coord[d] for d in MESH_DIMS)
    return mesh.mesh[index].flatten().tolist()


def layout_summary(mesh):
    """Two lines for rank 0 to print: world size, sizes, and the ranks in each of this rank's groups.

    mesh: the world DeviceMesh (a ParallelDims stands for its world_mesh).
    """
    mesh = getattr(mesh, "world_mesh", mesh)
    if mesh is None:
        return "world 1 (single process)"
    sizes = dict(zip(MESH_DIMS, mesh.mesh.shape))
    head = f"world {mesh.mesh.numel()} = " + " x ".join(f"{d} {sizes[d]}" for d in MESH_DIMS)
    rank = dist.get_rank()
    groups = ", ".join(f"{d} {group_ranks(mesh, (d,))}" for d in MESH_DIMS)
    groups += f", dp_cp {group_ranks(mesh, ('dp', 'cp'))}"
    return f"{head}\nrank {rank} coords {dict(zip(MESH_DIMS, mesh.get_coordinate()))} groups: {groups}"


@dataclass
class ParallelDims:
    """Sizes, this rank's coordinates, process groups and sub-meshes of one run.

    Single-process runs get all sizes 1, ranks 0 and None for every group and mesh.
    """
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    world_mesh: Optional[DeviceMesh] = None
    dp_mesh: Optional[DeviceMesh] = None
    dp_cp_mesh: Optional[DeviceMesh] = None
    pp_mesh: Optional[DeviceMesh] = None
    cp_mesh: Optional[DeviceMesh] = None
    tp_mesh: Optional[DeviceMesh] = None
    dp_group: Optional[dist.ProcessGroup] = None
    dp_cp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    cp_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None

    @classmethod
    def build(cls, world_size, dp=None, tp=1, pp=1, cp=1, device_type="cpu"):
        """Validate the layout and build the mesh (all sizes 1 and no groups for one process).

        Raises ValueError with a one-line message. Call after dist.init_process_group when world_size > 1.
        """
        dp, message = validate_layout(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
        if message:
            raise ValueError(message)
        if world_size == 1:
            return cls()
        return cls.from_mesh(*build_mesh(dp, pp, cp, tp, device_type))

    @classmethod
    def from_mesh(cls, mesh, dp_cp_mesh):
        """Fill sizes, coordinates, groups and sub-meshes from the two meshes build_mesh returns."""
        dp, pp, cp, tp = mesh.mesh.shape
        dp_rank, pp_rank, cp_rank, tp_rank = mesh.get_coordinate()
        sub = {d: mesh[d] for d in MESH_DIMS}
        return cls(dp=int(dp), pp=int(pp), cp=int(cp), tp=int(tp), dp_rank=dp_rank, pp_rank=pp_rank,
                   cp_rank=cp_rank, tp_rank=tp_rank, world_mesh=mesh, dp_mesh=sub["dp"],
                   dp_cp_mesh=dp_cp_mesh, pp_mesh=sub["pp"], cp_mesh=sub["cp"], tp_mesh=sub["tp"],
                   dp_group=sub["dp"].get_group(), dp_cp_group=dp_cp_mesh.get_group(),
                   pp_group=sub["pp"].get_group(), cp_group=sub["cp"].get_group(),
                   tp_group=sub["tp"].get_group())

    @property
    def world_size(self):
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_cp(self):
        """Size of the gradient-reduction group (data parallel x context parallel)."""
        return self.dp * self.cp

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1

    @property
    def counts_loss(self):
        """This rank's CE partial sums count in the global loss (last pipeline stage, tp rank 0)."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def counts_items(self):
        """This rank's target-token counts count once per dp rank (also cp rank 0)."""
        return self.counts_loss and self.cp_rank == 0

    def group(self, name):
        """The process group of dimension `name` (dp, pp, cp, tp, dp_cp); None on one process; unknown names raise."""
        if name not in GROUP_NAMES:
            raise KeyError(f"no parallel dimension {name!r}; known: {', '.join(GROUP_NAMES)}")
        return getattr(self, f"{name}_group")

    def mesh(self, name):
        """The 1-D DeviceMesh of dimension `name` (or "world"); None on one process; unknown names raise."""
        if name not in GROUP_NAMES + ("world",):
            raise KeyError(f"no mesh {name!r}; known: {', '.join(GROUP_NAMES + ('world',))}")
        return getattr(self, f"{name}_mesh")

    def summary(self):
        return layout_summary(self)
