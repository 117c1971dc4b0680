"""A one-unit linear head on the trunk's final norm, attached from outside the model file: it reads the norm's output
on every forward of the trunk, and the loss takes what it recorded (PPO's value head, the reward model's score head)."""
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class TrunkHead(nn.Linear):
    """hidden_size -> 1 on `model.model.norm`, kept there as the attribute ATTRIBUTE (so it is saved, sharded and
    wrapped with the model), built on the meta device and initialised by the subclass from its own generator (the
    global RNG stays the trunk's)."""
    ATTRIBUTE = None  # the norm's attribute the head is kept under

    def __init__(self, hidden_size, bias):
        super().__init__(hidden_size, 1, bias=bias, device="meta")  # its init draws nothing from the global RNG
        self.to_empty(device="cpu")
        self.recorded = None

    def attach(self, model):
        """Make this head `model.model.norm.<ATTRIBUTE>` and record its output on every forward of the trunk."""
        norm = model.model.norm
        setattr(norm, self.ATTRIBUTE, self.to(norm.weight.device))
        norm.register_forward_hook(self.capture)
        return self

    def capture(self, norm, inputs, output):
        # under tensor parallel the norm's output is still a Replicate DTensor here, as are this head's parameters
        recorded = self(output).squeeze(-1)
        self.recorded = recorded.to_local() if isinstance(recorded, DTensor) else recorded

    def take(self):
        """(N, L) fp32 outputs of the trunk's last forward (consumed)."""
        recorded, self.recorded = self.recorded, None
        return recorded.float()


def fill_uniform(head, seed):
    """nn.Linear's own initialisation, U(-1/sqrt(in), 1/sqrt(in)) for weight and bias, from `seed`'s generator."""
    generator, bound = torch.Generator().manual_seed(seed), 1 / math.sqrt(head.in_features)
    with torch.no_grad():
        head.weight.uniform_(-bound, bound, generator=generator)
        head.bias.uniform_(-bound, bound, generator=generator)
