"""The device mesh and the ParallelDims record the trainer passes around, both built from one table of parallel
dimensions (DIMENSIONS): a new dimension is one entry here plus its module in parallel/ (docs/design.md).

Rank order follows torchtitan: the last dimension (tp) varies fastest, then cp, then pp, then dp, so the tp group of
a rank is a run of consecutive ranks (one node, fast links) and dp spans the farthest ranks.
"""
from dataclasses import dataclass, field
from math import prod

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model.torch_compat import flatten_mesh


@dataclass(frozen=True)
class Dimension:
    """One parallel dimension: its name (the flag --<name> and the mesh dimension) and what it splits."""
    name: str
    shards: str
    splits_data: bool = False  # its ranks read different samples (the data-parallel replicas)
    reduces_gradients: bool = False  # gradients are summed over its ranks (with dp: the gradient-reduction group)


# mesh order: the first varies slowest (dp spans the farthest ranks), the last fastest
DIMENSIONS = (
    Dimension("dp", "the batch: DDP replicas or ZeRO/FSDP2 shards", splits_data=True, reduces_gradients=True),
    Dimension("pp", "the layers, into pipeline stages"),
    Dimension("cp", "each sequence, into chunks (ring attention)", reduces_gradients=True),
    Dimension("tp", "each layer's heads and MLP columns (DTensor)"),
)
MESH_DIMS = tuple(d.name for d in DIMENSIONS)
# the flattened gradient-reduction dimension (dp x cp)
REDUCE_DIMS = tuple(d.name for d in DIMENSIONS if d.reduces_gradients)
REDUCE_NAME = "_".join(REDUCE_DIMS)
GROUP_NAMES = MESH_DIMS + (REDUCE_NAME,)
MODEL_DIMS = tuple(d.name for d in DIMENSIONS if not d.splits_data)  # the sizes a layout flag sets; dp follows


def validate_layout(world_size, dp=None, **sizes):
    """Return (dp, None) for a valid layout, else (None, one line saying what to change).

    sizes: the model dimensions by name (tp=2, pp=2, ...; missing ones are 1); dp=None derives dp = world_size /
    their product.
    """
    unknown = set(sizes) - set(MODEL_DIMS)
    if unknown:
        raise KeyError(f"no parallel dimension {sorted(unknown)}; known: {', '.join(MESH_DIMS)}")
    sizes = {name: sizes.get(name, 1) for name in MODEL_DIMS}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            return None, f"--{name} must be an integer >= 1, got {size}"
    names, model_parallel = "*".join(MODEL_DIMS), prod(sizes.values())
    values = "*".join(str(s) for s in sizes.values())
    flags = "/".join(f"--{n}" for n in MODEL_DIMS)
    if dp is None:
        if world_size % model_parallel != 0:
            return None, (f"world size {world_size} is not divisible by {names} = {values} = {model_parallel}; "
                          f"launch a multiple of {model_parallel} processes or change {flags}")
        return world_size // model_parallel, None
    if not isinstance(dp, int) or dp < 1:
        return None, f"--dp must be an integer >= 1, got {dp}"
    if dp * model_parallel != world_size:
        return None, (f"dp*{names} = {dp}*{values} = {dp * model_parallel} but world size is {world_size}; "
                      f"launch {dp * model_parallel} processes or change --dp/{flags}")
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


def build_mesh(sizes, device_type):
    """init_device_mesh over the dimensions' sizes {name: size}, in mesh order; returns (world_mesh, reduce_mesh).

    reduce_mesh is the flattened dp x cp mesh over which gradients are reduced (= the dp mesh when cp=1).
    torch 2.11+ deprecates slicing a flattened dim from the root mesh, so keep the returned handle.
    """
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    reduce_mesh = flatten_mesh(mesh[REDUCE_DIMS], REDUCE_NAME)  # torchtitan's way (a private DeviceMesh method)
    if reduce_mesh is None:
        reduce_mesh = _flatten_with_new_groups(mesh, REDUCE_DIMS, REDUCE_NAME)
    return mesh, reduce_mesh


def group_ranks(mesh, dims):
    """Global ranks of this rank's group spanning `dims` (e.g. ("tp",) or ("dp", "cp")), from the mesh tensor."""
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    index = tuple(slice(None) if d in dims else coord[d] for d in MESH_DIMS)
    return mesh.mesh[index].flatten().tolist()


def layout_summary(mesh):
    """Two lines for rank 0 to print: world size, sizes, and the ranks in each of this rank's groups.

    mesh: the world DeviceMesh (a ParallelDims stands for its world mesh).
    """
    if isinstance(mesh, ParallelDims):
        mesh = mesh.mesh("world")
    if mesh is None:
        return "world 1 (single process)"
    sizes = dict(zip(MESH_DIMS, mesh.mesh.shape))
    head = f"world {mesh.mesh.numel()} = " + " x ".join(f"{d} {sizes[d]}" for d in MESH_DIMS)
    rank = dist.get_rank()
    groups = ", ".join(f"{d} {group_ranks(mesh, (d,))}" for d in MESH_DIMS)
    groups += f", {REDUCE_NAME} {group_ranks(mesh, REDUCE_DIMS)}"
    return f"{head}\nrank {rank} coords {dict(zip(MESH_DIMS, mesh.get_coordinate()))} groups: {groups}"


@dataclass
class ParallelDims:
    """Sizes, this rank's coordinates, process groups and sub-meshes of one run, by dimension name (DIMENSIONS,
    plus the flattened gradient-reduction dimension dp_cp). Single-process runs get size 1, rank 0 and None for
    every group and mesh."""
    sizes: dict = field(default_factory=lambda: dict.fromkeys(MESH_DIMS, 1))
    coords: dict = field(default_factory=lambda: dict.fromkeys(MESH_DIMS, 0))
    meshes: dict = field(default_factory=dict)  # name (or "world") -> DeviceMesh
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup

    @classmethod
    def build(cls, world_size, dp=None, device_type="cpu", **sizes):
        """Validate the layout (sizes: the model dimensions by name, e.g. tp=2) and build the mesh (all sizes 1 and
        no groups for one process). Raises ValueError with a one-line message. Call after dist.init_process_group
        when world_size > 1."""
        dp, message = validate_layout(world_size, dp=dp, **sizes)
        if message:
            raise ValueError(message)
        if world_size == 1:
            return cls()
        full = {name: (dp if name == "dp" else sizes.get(name, 1)) for name in MESH_DIMS}
        return cls.from_mesh(*build_mesh(full, device_type))

    @classmethod
    def from_mesh(cls, mesh, reduce_mesh):
        """Fill sizes, coordinates, groups and sub-meshes from the two meshes build_mesh returns."""
        meshes = {name: mesh[name] for name in MESH_DIMS}
        meshes.update({REDUCE_NAME: reduce_mesh, "world": mesh})
        return cls(sizes={name: int(size) for name, size in zip(MESH_DIMS, mesh.mesh.shape)},
                   coords=dict(zip(MESH_DIMS, mesh.get_coordinate())), meshes=meshes,
                   groups={name: meshes[name].get_group() for name in GROUP_NAMES})

    def size(self, name):
        """The size of dimension `name` (or the flattened dp_cp); unknown names raise."""
        if name == REDUCE_NAME:
            return prod(self.size(d) for d in REDUCE_DIMS)
        self._known(name, MESH_DIMS)
        return self.sizes[name]

    def rank(self, name):
        """This rank's coordinate along dimension `name`; unknown names raise."""
        self._known(name, MESH_DIMS)
        return self.coords[name]

    def group(self, name):
        """The process group of dimension `name` (dp, pp, cp, tp, dp_cp); None on one process; unknown names raise."""
        self._known(name, GROUP_NAMES)
        return self.groups.get(name)

    def mesh(self, name):
        """The 1-D DeviceMesh of dimension `name` (or "world"); None on one process; unknown names raise."""
        self._known(name, GROUP_NAMES + ("world",))
        return self.meshes.get(name)

    @staticmethod
    def _known(name, names):
        if name not in names:
            raise KeyError(f"no parallel dimension {name!r}; known: {', '.join(names)}")

    @property
    def world_size(self):
        return prod(self.sizes.values())

    @property
    def data_replicas(self):
        """How many ranks read different samples (the product of the dimensions that split the data)."""
        return prod(self.sizes[d.name] for d in DIMENSIONS if d.splits_data)

    @property
    def is_last_stage(self):
        return self.rank("pp") == self.size("pp") - 1

    @property
    def counts_loss(self):
        """This rank's CE partial sums count in the global loss (last pipeline stage, tp rank 0)."""
        return self.is_last_stage and self.rank("tp") == 0

    @property
    def counts_items(self):
        """This rank's target-token counts count once per dp rank (also cp rank 0)."""
        return self.counts_loss and self.rank("cp") == 0

    def summary(self):
        return layout_summary(self)
