"""The sampling settings of one request (SamplingParams) and their checks. Without torch: the
command line checks its flags with them before the model's stack loads (core/sampling.py samples)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidValue


# Defaults for models that recommend none (no generation_config.json, no general.sampling.* keys).
# Cooler than llama.cpp's (0.8 / 40 / 0.95 / 0.05): on small models those derail answers. Measured
# (bench/sampling.py, 5 factual questions x 20 seeds, 2026-11-25): Gemma 3 270M right 42% -> 58%
# and looping 21% -> 0%; SmolLM2-135M right 78% -> 79%, looping 4% -> 9% (the loop stop ends those).
@dataclass
class SamplingParams:
    temperature: float = 0.3  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.9  # 1 disables
    min_p: float = 0.1  # 0 disables
    repetition_penalty: float = 1.0  # 1 disables
    seed: int | None = None
    # OpenAI's: logits[t] -= presence * (c[t] > 0) + frequency * c[t], c[t] counting t among the
    # tokens generated so far in this answer (not the prompt); 0 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Not a sampling rule, but it travels with them per request: end the answer when it falls into
    # an exact repetition loop (output_stream.LoopGuard). Off in the API, on in generate and chat.
    stop_loops: bool = False

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0):
            raise InvalidValue("temperature", self.temperature, "must be >= 0")
        if self.top_k < 0:
            raise InvalidValue("top_k", self.top_k, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidValue("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise InvalidValue("min_p", self.min_p, "must be in [0, 1)")
        if not 1e-3 <= self.repetition_penalty <= 1e3:  # beyond, penalized logits overflow float32
            raise InvalidValue("repetition_penalty", self.repetition_penalty, "must be in [0.001, 1000]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidValue(name, getattr(self, name), "must be in [-2, 2]")
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidValue("logit_bias", f"{len(self.logit_bias)} entries" if isinstance(self.logit_bias, dict)
                               else self.logit_bias, f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidValue("logit_bias", t, "keys must be token ids (integers >= 0)")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise InvalidValue("logit_bias", b, "biases must be numbers in [-100, 100]")
        return self

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (then the caller tracks the history)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
