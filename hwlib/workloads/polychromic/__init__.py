"""The Polychromic trainer (seed 001) as a workload: a Qwen3-shaped causal LM with LoRA, a BERT-shaped
sentence encoder, a diversity bonus every 5th step, and four ways to generate its replies.

``config`` (sizes and checks), ``build`` (models from configs, random weights, fast), ``decode``
(the generation ladder a-d and the lab's own decode loop), ``trainer`` (the step, the bonus's
phases, the seed's objective and a policy-gradient form). Notebook 14 measures it through
``hwlib.studies.generation``. It is not one of the cumulative-ladder workloads of notebooks 01-11:
its ladder is the generation ladder of notebook 14.
"""

from .config import PROFILES, PolyConfig, check_config, check_sampling, config, param_count
from .decode import WAYS, OwnDecodeLoop, generate, sample_top_p
from .trainer import (PHASES, Trainer, advantages, pg_reference_grads, rewards, seed_objective_grads)

__all__ = ["PROFILES", "PolyConfig", "check_config", "check_sampling", "config", "param_count", "WAYS",
           "OwnDecodeLoop", "generate", "sample_top_p", "PHASES", "Trainer", "advantages", "pg_reference_grads",
           "rewards", "seed_objective_grads"]
