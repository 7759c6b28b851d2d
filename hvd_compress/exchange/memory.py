"""Error feedback: what quantisation drops from a gradient is added to the next one.

Without it, an 8-bit gradient's rounding error is lost every step; with it, the error is
carried per parameter and re-enters the exchange later, so over many steps the applied
update follows the true gradient (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD").

While training runs, a residual is kept per bucket (one flat float32 tensor the communicator
adds into the bucket's buffer in place). A bucket's parameters can change under it: DDP
rebuilds its buckets after the first step, reordering the parameters inside a bucket of the
same index and size, and a checkpoint may be resumed with other buckets. So a front binds each
bucket to its parameters (bind); when a bucket is bound to other parameters, or to the same
ones in another order, every residual that held one of them is cut into its parameters'
pieces first, and the bucket's residual is put together from its own parameters' pieces. A
checkpoint keeps the pieces, by parameter name.
"""
import torch

from ..roles import Memory

__all__ = ["ResidualMemory"]


class ResidualMemory(Memory):
    """Residuals by name (a bucket's, or a tensor's): compensate before compressing, update
    after; bound buckets' residuals follow their parameters."""

    def __init__(self):
        self.residuals = {}          # bucket (or tensor) name -> its residual
        self._members = {}           # bound bucket name -> (parameter names, numels)
        self._pieces = {}            # parameter name -> residual of a parameter in no bucket

    def compensate(self, name, grad, inplace=False):
        """The gradient plus the residual left by the previous step (float32). inplace=True adds
        into `grad` itself (a bucket's own float32 buffer) instead of allocating."""
        g = grad.detach() if inplace else grad.detach().to(torch.float32)
        residual = self._residual(name)
        if residual is not None and residual.shape != g.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(residual.shape)}, "
                             f"gradient {tuple(g.shape)}")
        if inplace:
            return g if residual is None else g.add_(residual)
        if residual is None:
            return g.clone() if g.data_ptr() == grad.data_ptr() else g
        return g + residual

    def _residual(self, name):
        """The residual of `name`; an unbound name takes up a restored piece of its own name
        (a per-tensor method's residual, by the tensor's name)."""
        residual = self.residuals.get(name)
        if residual is None and name not in self._members and name in self._pieces:
            residual = self.residuals[name] = self._pieces.pop(name)
        return residual

    def remember(self, name, compensated, kept):
        """Store compensated - kept, where kept is what this rank's packet decodes to: exactly
        what quantisation dropped. Non-finite entries leave a zero residual (a NaN/Inf gradient
        must not poison every later step; it stays visible in the step that carried it)."""
        residual = compensated.detach().to(torch.float32) - kept.detach().to(torch.float32).view(compensated.shape)
        residual.masked_fill_(~torch.isfinite(residual), 0.0)
        self.residuals[name] = residual
        return residual

    # ---- buckets and their parameters ---------------------------------------------------------
    def bind(self, name, names, numels, device=None):
        """Bucket `name` holds the parameters `names` ([numels] values each), in this order,
        from now on. Nothing changes where it already did; otherwise every bound residual that
        holds one of them (this bucket's own included) is cut into pieces, and this bucket's
        is put together from its parameters' pieces, zeros for a parameter with none."""
        members = (tuple(names), tuple(int(k) for k in numels))
        if self._members.get(name) == members:
            return
        wanted = set(members[0])
        for other in [b for b, (held, _) in self._members.items()
                      if b == name or wanted & set(held)]:
            self._unbind(other)
        self.residuals.pop(name, None)
        self._members[name] = members
        self._assemble(name, device)

    def _unbind(self, name):
        names, numels = self._members.pop(name)
        residual = self.residuals.pop(name, None)
        if residual is not None:
            for n, piece in zip(names, residual.reshape(-1).split(list(numels))):
                self._pieces[n] = piece

    def _assemble(self, name, device=None):
        """Bucket `name`'s residual from its parameters' pieces (those of another size are
        dropped: that parameter changed), if any piece is known."""
        names, numels = self._members[name]
        pieces = [self._pieces.pop(n, None) for n in names]
        pieces = [p.reshape(-1) if p is not None and p.numel() == k else None
                  for p, k in zip(pieces, numels)]
        known = [p for p in pieces if p is not None]
        if not known:
            return
        device = device if device is not None else known[0].device
        self.residuals[name] = torch.cat([
            p.to(device, torch.float32) if p is not None else
            torch.zeros(k, dtype=torch.float32, device=device) for p, k in zip(pieces, numels)])

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self):
        """Every residual by parameter name (a bound bucket's cut into its parameters' pieces),
        or by its own name where it is no bound bucket's (a per-tensor method's)."""
        state = {k: v.clone() for k, v in self._pieces.items()}
        for name, residual in self.residuals.items():
            if name in self._members:
                names, numels = self._members[name]
                pieces = residual.reshape(-1).split(list(numels))
                state.update(zip(names, (p.clone() for p in pieces)))
            else:
                state[name] = residual.clone()
        return state

    def load_state_dict(self, state):
        """Restore a state_dict(): every bound bucket takes up its parameters' pieces; the rest
        wait for the bucket (or the tensor of that name) that asks for them. A residual under
        a bound bucket's own name and of its size is that bucket's (a checkpoint from before
        residuals were kept by parameter)."""
        self.residuals, self._pieces = {}, {}
        for name, residual in state.items():
            numels = self._members.get(name, ((), ()))[1]
            if len(numels) > 1 and residual.numel() == sum(numels):
                self.residuals[name] = residual.reshape(-1).clone()
            else:
                self._pieces[name] = residual.clone()
        for name in self._members:
            if name not in self.residuals:
                self._assemble(name)
