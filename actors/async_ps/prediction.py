"""Weight prediction: workers compute each gradient at the parameters it will most likely be applied to.

A gradient computed on version ``v`` is applied to version ``v + s``, ``s`` updates later (its staleness),
and with Adam a gradient of the past pulls the parameters back where they were: on the slow-links job
(digits, AdamW) gradients 1-2 updates stale needed 1.6x the updates of synchronous training to reach its
loss. A server that serves ``w_v + s_hat * (w_v - w_{v-1})`` instead, the last update extrapolated over
the staleness its recent updates had (``s_hat``, an exponential average), lets a worker compute the
gradient about where it lands: weight prediction, as SpecTrain (Chen et al., 2018) and PipeMare (Yang et
al., 2021) do for pipelines. The server still applies the gradient to ``w``; only what it serves changes.
One worker (every gradient fresh: ``s_hat`` = 0) is served ``w`` itself, and trains exactly as ddp does.

Example::

    predictor = WeightPredictor(params)        # a server's own parameters, by name
    predictor.before_update()                  # keep w_{v-1}
    optimizer.step()
    predictor.observe(staleness=1)             # the applied update's staleness
    served = predictor.served(version)         # w_v + s_hat * (w_v - w_{v-1}), once per version
"""

from __future__ import annotations

import torch

STALENESS_AVERAGING = 0.1
"""Weight of each applied update's staleness in ``s_hat``: it follows a change in how many workers are in
flight (one lost or added) within ~10 updates."""


class WeightPredictor:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.previous = {name: p.detach().clone() for name, p in params.items()}
        self.expected_staleness = 0.0
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    def before_update(self) -> None:
        """Keep the parameters as they are now: the update about to be applied is the one extrapolated."""
        with torch.no_grad():
            for name, p in self.params.items():
                self.previous[name].copy_(p)

    def observe(self, staleness: int) -> None:
        self.expected_staleness += STALENESS_AVERAGING * (staleness - self.expected_staleness)

    def served(self, version: int) -> dict[str, torch.Tensor]:
        """The parameters a worker should compute version ``version``'s next gradient on."""
        if self.expected_staleness == 0.0:
            return dict(self.params)
        if self._cache is None or self._cache[0] != version:
            with torch.no_grad():
                predicted = {name: torch.lerp(self.previous[name], p, 1.0 + self.expected_staleness)
                             for name, p in self.params.items()}
            self._cache = (version, predicted)
        return self._cache[1]

    def state_dict(self) -> dict:
        return {"previous": {name: t.clone() for name, t in self.previous.items()},
                "expected_staleness": self.expected_staleness}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state (one without prediction state: no extrapolation until the next update)."""
        with torch.no_grad():
            for name, p in self.params.items():
                self.previous[name].copy_(state.get("previous", {}).get(name, p))
        self.expected_staleness = float(state.get("expected_staleness", 0.0))
        self._cache = None
