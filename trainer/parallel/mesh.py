"""The device mesh and the ParallelDims record the trainer passes around, both built from one table of parallel
dimensions (DIMENSIONS): a new dimension is one entry here, its module in parallel/, a planner term (docs/design.md).

Rank order follows torchtitan: the last dimension (tp) varies fastest, then cp, then pp, then dp, so the tp group of
a rank is a run of consecutive ranks (one node, fast links) and dp spans the farthest ranks.

A dimension `within` another (ep within dp, torchtitan's way) is carved out of that one's ranks instead of multiplying
the world size: its groups are the consecutive ep-sized slices of each dp group, and its "replica" groups (ep_replica)
join the ranks holding the same slice position, i.e. the same experts, across the slices and the cp ranks (every
gradient-reducing dimension: those ranks see other tokens of the same experts).
"""
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model.torch_compat import flatten_mesh


@dataclass(frozen=True)
class Dimension:
    """One parallel dimension: its name (the flag --<name> and the mesh dimension) and what it splits."""
    name: str
    title: str  # in one-line messages: "the <title> size"
    shards: str
    splits_data: bool = False  # its ranks read different samples (the data-parallel replicas)
    reduces_gradients: bool = False  # gradients are summed over its ranks (with dp: the gradient-reduction group)
    within: str = None  # carved out of that dimension's ranks (its size divides it), not a dimension of the mesh
    module: str = None  # the module applying it, with its check validate(args, config, zero_stage): read when used
    # (a registry entry: tests/test_house.py checks that the module exists on this floor or below)
    divides: tuple = ()  # what of a rank's share it cuts, for the layout planner (scripts/planner/cost.py PARTS)


# mesh order: the first varies slowest (dp spans the farthest ranks), the last fastest
DIMENSIONS = (
    Dimension("dp", "data-parallel", "the batch: DDP replicas or ZeRO/FSDP2 shards", splits_data=True,
              reduces_gradients=True, module="trainer.parallel.data"),
    Dimension("pp", "pipeline", "the layers, into pipeline stages", module="trainer.parallel.pipeline",
              divides=("layers",)),
    Dimension("cp", "context-parallel", "each sequence, into chunks (ring attention)", reduces_gradients=True,
              module="trainer.parallel.context", divides=("tokens",)),
    Dimension("tp", "tensor-parallel", "each layer's heads and MLP columns (DTensor)",
              module="trainer.parallel.tensor", divides=("matrices",)),
    Dimension("ep", "expert-parallel", "each MoE layer's routed experts (tokens sent by all-to-all)", within="dp",
              module="trainer.parallel.expert", divides=("experts",)),
)
BY_NAME = {d.name: d for d in DIMENSIONS}
MESH_DIMS = tuple(d.name for d in DIMENSIONS if d.within is None)
CARVED = {d.name: d.within for d in DIMENSIONS if d.within}  # name -> the dimension it is carved from
REPLICA_NAMES = tuple(f"{name}_replica" for name in CARVED)  # the ranks holding the same shard of a carved dimension
REDUCE_DIMS = tuple(d.name for d in DIMENSIONS if d.reduces_gradients)
REDUCE_NAME = "_".join(REDUCE_DIMS)  # the flattened gradient-reduction dimension (dp_cp)
GROUP_NAMES = MESH_DIMS + (REDUCE_NAME,) + tuple(CARVED) + REPLICA_NAMES
MODEL_DIMS = tuple(d.name for d in DIMENSIONS if not d.splits_data)  # the sizes a layout flag sets; dp follows
PRODUCT_DIMS = tuple(name for name in MODEL_DIMS if name in MESH_DIMS)  # world size = dp * their product


def grad_reduce_factor(sizes):
    """The ranks a gradient is averaged over, the product of the REDUCE_DIMS sizes (dp x cp): what the trainer scales
    each rank's loss by so that DDP's and FSDP2's average is the summed gradient (parallel/data.py), and what ZeRO
    shards the states over. sizes: by dimension name, a mapping (missing ones 1) or the plan's Layout (attributes)."""
    if not isinstance(sizes, Mapping):
        sizes = {name: getattr(sizes, name) for name in REDUCE_DIMS}
    return prod(sizes.get(name, 1) for name in REDUCE_DIMS)


def dimension_module(name):
    """The module of dimension `name` (its DIMENSIONS entry), imported on first use: a run reads the code of the
    dimensions it uses only."""
    return importlib.import_module(BY_NAME[name].module)


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
    names, model_parallel = "*".join(PRODUCT_DIMS), prod(sizes[n] for n in PRODUCT_DIMS)
    values = "*".join(str(sizes[n]) for n in PRODUCT_DIMS)
    flags = "/".join(f"--{n}" for n in PRODUCT_DIMS)
    if dp is None:
        if world_size % model_parallel != 0:
            return None, (f"world size {world_size} is not divisible by {names} = {values} = {model_parallel}; "
                          f"launch a multiple of {model_parallel} processes or change {flags}")
        dp = world_size // model_parallel
    elif not isinstance(dp, int) or dp < 1:
        return None, f"dp must be an integer >= 1, got {dp}"
    elif dp * model_parallel != world_size:
        return None, (f"dp*{names} = {dp}*{values} = {dp * model_parallel} but world size is {world_size}; "
                      f"launch {dp * model_parallel} processes or change {flags}")
    message = _carved_message(dict(sizes, dp=dp))
    return (None, message) if message else (dp, None)


def _carved_message(sizes):
    """One line if a carved dimension's size does not divide the size it is carved from (ep must divide dp)."""
    for name, parent in CARVED.items():
        if sizes[parent] % sizes[name]:
            return (f"--{name} {sizes[name]} must divide the {BY_NAME[parent].title} size ({sizes[parent]}): its "
                    f"ranks are carved out of the {parent} ranks; launch a multiple of {sizes[name]} {parent} ranks "
                    f"per {'*'.join(PRODUCT_DIMS)} group, or change --{name}")
    return None


def carved_groups(world, parent, size):
    """(slices, replicas): the rank lists of a dimension of `size` carved out of `parent`, from the world mesh tensor
    (sizes in MESH_DIMS order). slices: consecutive size-rank runs of each parent group; replicas: in each dp_cp
    group, the ranks at the same position in their slice (the same shard), whatever their cp coordinate."""
    parent_size = world.shape[MESH_DIMS.index(parent)]
    rows = world.movedim(MESH_DIMS.index(parent), -1).reshape(-1, parent_size).tolist()
    slices = [row[i:i + size] for row in rows for i in range(0, len(row), size)]
    # (other dims, other reducing dims, parent): each block is one dp_cp group, the parent's ranks last
    kept = [MESH_DIMS.index(d) for d in MESH_DIMS if d not in REDUCE_DIMS]
    reducing = [MESH_DIMS.index(d) for d in REDUCE_DIMS if d != parent] + [MESH_DIMS.index(parent)]
    peers = prod(world.shape[i] for i in reducing) // parent_size  # the other reducing dims (cp) per parent rank
    blocks = world.permute(*kept, *reducing).reshape(-1, peers, parent_size)
    replicas = [sorted(block[:, j::size].flatten().tolist()) for block in blocks for j in range(size)]
    return slices, replicas


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

    mesh: the world DeviceMesh, or a ParallelDims (its world mesh, and the carved dimensions it has).
    """
    dims = mesh if isinstance(mesh, ParallelDims) else None
    mesh = dims.mesh("world") if dims else mesh
    if mesh is None:
        return "world 1 (single process)"
    sizes = dict(zip(MESH_DIMS, mesh.mesh.shape))
    head = f"world {mesh.mesh.numel()} = " + " x ".join(f"{d} {sizes[d]}" for d in MESH_DIMS)
    rank = dist.get_rank()
    groups = ", ".join(f"{d} {group_ranks(mesh, (d,))}" for d in MESH_DIMS)
    groups += f", {REDUCE_NAME} {group_ranks(mesh, REDUCE_DIMS)}"
    for name, parent in CARVED.items():  # a carved dimension (ep) is not a mesh axis: named with its groups
        if dims and dims.size(name) > 1:
            head += f", {name} {dims.size(name)} within {parent}"
            groups += "".join(f", {g} {dist.get_process_group_ranks(dims.group(g))}" for g in (name, f"{name}_replica"))
    return f"{head}\nrank {rank} coords {dict(zip(MESH_DIMS, mesh.get_coordinate()))} groups: {groups}"


@dataclass
class ParallelDims:
    """Sizes, this rank's coordinates, process groups and sub-meshes of one run, by dimension name (DIMENSIONS,
    plus the flattened gradient-reduction dimension dp_cp and the carved dimensions' replica groups, ep_replica).
    Single-process runs get size 1, rank 0 and None for every group and mesh; a carved dimension of size 1 has no
    group (None) and its replica group is dp_cp's."""
    sizes: dict = field(default_factory=lambda: dict.fromkeys(MESH_DIMS + tuple(CARVED), 1))
    coords: dict = field(default_factory=lambda: dict.fromkeys(MESH_DIMS + tuple(CARVED), 0))
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
        dims = cls.from_mesh(*build_mesh(full, device_type))
        for name in CARVED:
            dims.carve(name, sizes.get(name, 1))
        return dims

    @classmethod
    def from_mesh(cls, mesh, reduce_mesh):
        """Fill sizes, coordinates, groups and sub-meshes from the two meshes build_mesh returns (carved sizes 1)."""
        meshes = {name: mesh[name] for name in MESH_DIMS}
        meshes.update({REDUCE_NAME: reduce_mesh, "world": mesh})
        groups = {name: meshes[name].get_group() for name in MESH_DIMS + (REDUCE_NAME,)}
        groups.update({f"{name}_replica": groups[REDUCE_NAME] for name in CARVED})  # uncarved: every peer holds all
        sizes = {name: int(size) for name, size in zip(MESH_DIMS, mesh.mesh.shape)}
        return cls(sizes=dict(sizes, **dict.fromkeys(CARVED, 1)), meshes=meshes, groups=groups,
                   coords=dict(zip(MESH_DIMS, mesh.get_coordinate()), **dict.fromkeys(CARVED, 0)))

    def carve(self, name, size):
        """Split every group of the dimension `name` is carved from into consecutive `size`-rank slices (the groups
        of `name`) and the groups of same-position ranks across the slices and the other gradient-reducing
        dimensions (`name`_replica; with cp: the cp peers too). A collective: every rank creates every group, in the
        same order (torch's new_subgroups_by_enumeration)."""
        if size == 1:
            return
        parent = CARVED[name]
        slices, replicas = carved_groups(self.meshes["world"].mesh, parent, size)
        self.groups[name], _ = dist.new_subgroups_by_enumeration(slices)
        self.groups[f"{name}_replica"], _ = dist.new_subgroups_by_enumeration(replicas)
        self.sizes[name] = size
        self.coords[name] = self.coords[parent] % size

    def size(self, name):
        """The size of dimension `name` (or the flattened dp_cp, or a replica group); unknown names raise."""
        if name == REDUCE_NAME:
            return prod(self.size(d) for d in REDUCE_DIMS)
        carved = name.removesuffix("_replica")
        if name in REPLICA_NAMES:  # the gradient-reducing ranks holding the same shard
            return self.size(REDUCE_NAME) // self.size(carved)
        self._known(name, MESH_DIMS + tuple(CARVED))
        return self.sizes[name]

    def rank(self, name):
        """This rank's coordinate along dimension `name`; unknown names raise."""
        self._known(name, MESH_DIMS + tuple(CARVED))
        return self.coords[name]

    def group(self, name):
        """The process group of dimension `name` (dp, pp, cp, tp, dp_cp, ep, ep_replica); None on one process;
        unknown names raise."""
        self._known(name, GROUP_NAMES)
        return self.groups.get(name)

    def mesh(self, name):
        """The 1-D DeviceMesh of mesh dimension `name` (or dp_cp, or "world"); None on one process; unknown names
        raise."""
        self._known(name, MESH_DIMS + (REDUCE_NAME, "world"))
        return self.meshes.get(name)

    @staticmethod
    def _known(name, names):
        if name not in names:
            raise KeyError(f"no parallel dimension {name!r}; known: {', '.join(names)}")

    @property
    def world_size(self):
        return prod(self.sizes[name] for name in MESH_DIMS)

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
