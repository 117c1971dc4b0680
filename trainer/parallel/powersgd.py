"""PowerSGD (torch's DDP communication hook) with a state that resumes exactly.

torch's PowerSGDState keeps, per DDP bucket index, this rank's error-feedback residual (one flat tensor over the
bucket's gradients) and the Q matrices that warm-start the next step's power iteration. A bucket index does not name
the same parameters for long: DDP lays its buckets out anew in every process and lays them out again after the first
backward (in the order the gradients became ready). Within one run that rebuild happens during the exact warm-up, so
torch never meets it; a resumed process meets it with the state of a compressed step in hand.

So this hook runs torch's unchanged, and moves every parameter's residual and Q to where its gradient is: in a
resumed process from the saved pieces at each bucket's first call, and again across DDP's rebuild. state_dict()
holds them per parameter name, with the step counter and the random generator that seeds a bucket's first Q: a
resumed run compresses its first step as the uninterrupted run compressed that step. The rest of torch's per-bucket
state (the P buffers) is overwritten before it is read, every step.
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd


class ResumablePowerSGD:
    """torch's powerSGD_hook and PowerSGDState (matrix rank `rank`, exact all-reduce for the first `start_iter`
    steps), its state kept per parameter across DDP's bucket layouts. Register with
    `ddp.register_comm_hook(powersgd.state, powersgd.hook)`; `names` maps id(parameter) to the parameter's name."""

    def __init__(self, group, rank, start_iter, names):
        self.state = torch_powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                                  start_powerSGD_iter=start_iter)
        self.names = names
        self.layouts = {}  # bucket index -> [(name, offset, shape)] the state's entries for it are laid out by
        self.pieces = {}  # name -> {"error": tensor, "q": tensor}: state waiting for its parameter's bucket
        self.backwards = 0  # backward passes this hook reduced in this process
        # torch's hook starts a bucket's second and third all-reduce from the first one's completion callback; under
        # gloo those callbacks interleave with the next bucket's all-reduces in another order on each rank, and gloo
        # matches collectives by order: with two buckets or more the ranks exchanged mismatched buffers and aborted
        # ("op.preamble.length <= op.nbytes. 256 vs 128", torch 2.13). NCCL orders them on its stream.
        self.serial = dist.get_backend(group) == "gloo"

    def hook(self, state, bucket):
        """The hook. DDP calls it bucket by bucket in index order (bucket.is_last() ends a backward) and lays its
        buckets out again once, before its second backward: there, with every earlier future complete, the state is
        cut into pieces, which each bucket then takes at its call."""
        buffer, index = bucket.buffer(), bucket.index()
        layout = [(self.names[id(p)], (g.data_ptr() - buffer.data_ptr()) // g.element_size(), tuple(g.shape))
                  for p, g in zip(bucket.parameters(), bucket.gradients())]
        if index == 0 and self.backwards == 1:
            self.pieces.update(self._take_apart())
            self._clear()
        if index not in self.layouts:
            self._lay_out(index, layout, buffer)
        elif self.layouts[index] != layout:
            raise RuntimeError(f"DDP laid out bucket {index} again after its second backward; PowerSGD's state for "
                               "it would reach other parameters")
        self.backwards += bucket.is_last()
        future = torch_powersgd.powerSGD_hook(state, bucket)
        if self.serial:  # gloo: the bucket's three all-reduces done before the next bucket starts its own
            future.wait()
        return future

    def _clear(self):
        self.layouts.clear()
        for entries in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            entries.clear()

    def _q_slices(self, layout):
        """(name, start, length) of each compressed gradient's Q in its bucket's Q memory, and the sizes of the Q and
        P memories: torch's order (gradients grouped by matrix shape, the groups in order of first appearance) and
        rule for compressing (an n x m gradient whose rank-r factors, n r + m r values, are smaller than n m by the
        state's min_compression_rate)."""
        groups = {}
        for name, _, shape in layout:
            n = shape[0] if shape else 1
            m = torch.Size(shape).numel() // n if n else 0
            r = min(n, m, self.state.matrix_approximation_rank)
            if (n + m) * r * self.state.min_compression_rate < n * m:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        slices, q_total, p_total = [], 0, 0
        for members in groups.values():
            for name, p_length, q_length in members:
                slices.append((name, q_total, q_length))
                q_total, p_total = q_total + q_length, p_total + p_length
        return slices, q_total, p_total

    def _take_apart(self):
        """Every bucket's residual and Q, cut into each parameter's own pieces (copies)."""
        pieces = {}
        for index, layout in self.layouts.items():
            error = self.state.error_dict.get(index)
            for name, offset, shape in layout:
                if error is not None:
                    pieces.setdefault(name, {})["error"] = error[offset:offset + torch.Size(shape).numel()].clone()
            q = self.state.q_memory_dict.get(index)
            slices, total, _ = self._q_slices(layout)
            if q is not None:
                if q.numel() != total:
                    raise RuntimeError(f"PowerSGD's Q memory of bucket {index} holds {q.numel()} values where its "
                                       f"layout gives {total}: torch changed how PowerSGD lays out Q")
                for name, start, length in slices:
                    pieces.setdefault(name, {})["q"] = q[start:start + length].clone()
        return pieces

    def _lay_out(self, index, layout, buffer):
        """The pieces of this bucket's parameters into torch's per-bucket entries; records the layout."""
        self.layouts[index] = layout
        own = [self.pieces.get(name, {}) for name, _, _ in layout]
        if any("error" in piece for piece in own):
            error = torch.zeros(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
            for (_, offset, shape), piece in zip(layout, own):
                if "error" in piece:
                    error[offset:offset + torch.Size(shape).numel()] = piece["error"].to(buffer.device)
            self.state.error_dict[index] = error
        slices, _, p_total = self._q_slices(layout)
        if slices and all("q" in self.pieces.get(name, {}) for name, _, _ in slices):  # else torch draws new Qs
            self.state.q_memory_dict[index] = torch.cat([self.pieces[name]["q"].to(buffer.device)
                                                         for name, _, _ in slices])
            self.state.p_memory_dict[index] = torch.empty(p_total, dtype=buffer.dtype, device=buffer.device)
        for name, _, _ in layout:
            self.pieces.pop(name, None)

    def state_dict(self):
        """This rank's state by parameter name: residuals, Qs, the step counter, the generator of first Qs."""
        pieces = {**self.pieces, **self._take_apart()}
        return {"iter": self.state.iter, "rng": self.state.rng.get_state(),
                "pieces": {name: {k: v.cpu() for k, v in piece.items()} for name, piece in pieces.items()}}

    def load_state_dict(self, saved):
        """A saved state_dict(); its pieces go to their parameters' buckets at each bucket's next hook call."""
        self.state.iter = saved["iter"]
        self.state.rng.set_state(saved["rng"])
        self.pieces = dict(saved["pieces"])
        self._clear()

