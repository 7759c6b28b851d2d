"""Error feedback: what quantisation drops from a gradient is added to the next one.

Without it, an 8-bit gradient's rounding error is lost every step; with it, the error is
carried per parameter and re-enters the exchange later, so over many steps the applied
update follows the true gradient (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD").
"""
import torch

from ..roles import Memory

__all__ = ["ResidualMemory"]


class ResidualMemory(Memory):
    """Residuals by name (a bucket's, or a tensor's): compensate before compressing, update after."""

    def __init__(self):
        self.residuals = {}

    def compensate(self, name, grad, inplace=False):
        """The gradient plus the residual left by the previous step (float32). inplace=True adds
        into `grad` itself (a bucket's own float32 buffer) instead of allocating."""
        g = grad.detach() if inplace else grad.detach().to(torch.float32)
        residual = self.residuals.get(name)
        if residual is not None and residual.shape != g.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(residual.shape)}, "
                             f"gradient {tuple(g.shape)}")
        if inplace:
            return g if residual is None else g.add_(residual)
        if residual is None:
            return g.clone() if g.data_ptr() == grad.data_ptr() else g
        return g + residual

    def remember(self, name, compensated, kept):
        """Store compensated - kept, where kept is what this rank's packet decodes to: exactly
        what quantisation dropped. Non-finite entries leave a zero residual (a NaN/Inf gradient
        must not poison every later step; it stays visible in the step that carried it)."""
        residual = compensated.detach().to(torch.float32) - kept.detach().to(torch.float32).view(compensated.shape)
        residual.masked_fill_(~torch.isfinite(residual), 0.0)
        self.residuals[name] = residual
        return residual

    def state_dict(self):
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state):
        self.residuals = {k: v.clone() for k, v in state.items()}
