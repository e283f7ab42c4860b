"""How strong an adapter may be applied. Plain values, no torch.

A leaf: request validation (engine/request_rules.py) refuses strengths beyond the limit, and adapter
conversion (engine/adapters/formats/tensor_checks.py) refuses lora_B factors that would overflow the model's
dtype at it; neither imports the other for it.
"""

from __future__ import annotations

# The largest |strength| a request may ask for (negative strengths down to its negative).
MAX_ADAPTER_SCALE = 8.0
