"""What the packages the engine imports would print at start-up that says nothing to an operator, kept unsaid.

Called once per process by the commands that serve (`loraswap serve`, `loraswap demo`), before anything
imports diffusers or transformers:
- torchao stays unimported unless --quantize asks for it. transformers and diffusers import it whenever it is
  installed, and its import prints warnings about optional CUDA kernels that fail to load (all of them on a
  CPU), a missing Triton, torch pytree deprecations and diffusers' "Unable to import torchao Tensor objects".
  A `None` in sys.modules is Python's own way to mark a package absent: find_spec answers None (so both
  libraries see no torchao) and an import raises ImportError.
- transformers' warning that an image processor falls back to its PIL twin without torchvision (the
  pipelines name processors they never use here) is silenced at its logger; its errors still show.
- The libraries' loading progress bars are turned off: start-up logs its own phases with their durations.
"""

from __future__ import annotations

import logging
import sys

# Loggers whose warnings are notices about optional packages, never about what this server does.
_NOTICE_LOGGERS = ("transformers.utils.import_utils",)


def quiet_foreign_packages(quantize: str) -> None:
    """Keep torchao out unless `quantize` needs it, and silence the notices and progress bars described above."""
    if quantize == "none" and "torchao" not in sys.modules:
        sys.modules["torchao"] = None  # type: ignore[assignment]
    for name in _NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
