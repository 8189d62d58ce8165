"""fp16 loss scaling (Micikevicius et al. 2018) with Megatron's dynamic rule.

The loss is multiplied by the scale before backward so small fp16 gradients do not
underflow; the optimizer divides it out. On an overflow (inf/nan in any gradient) the
step is skipped and, after `hysteresis` consecutive overflows, the scale is halved; after
`window` clean steps it is doubled.
"""

from megalite.config import PrecisionConfig


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool):
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict):
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.window, self.hysteresis = window, hysteresis
        self._clean_steps, self._hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.window:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict):
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def build_grad_scaler(config: PrecisionConfig):
    """None unless --fp16: bf16 has fp32's exponent range and needs no scaling."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                             config.loss_scale_window, config.hysteresis)
