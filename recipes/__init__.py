"""The jobs (``generate``, ``serve``, ``rollout``, ``plan``) and the ``reshard`` command.

A job started as ``python -m reshard.recipes.<job>`` (torchrun's ranks, the launcher's through
:mod:`reshard.recipes.rank`) imports this package first, while Python still holds ``"-m"`` in
``sys.argv[0]``: the cyclic garbage collector is paused here for the job module's imports. Torch,
transformers and the library make about 1.5 million objects and free almost none, yet the
collector walks them over and over as they come: a sixth of a rank's start-up CPU (1.3 of 7.9 s
here). The job resumes it once its imports are done, with them frozen
(:func:`reshard.recipes.exits.freeze_heap`, the first thing every job and the command run).
"""

import gc
import sys

if sys.argv[:1] == ["-m"]:  # (an ``import reshard.recipes...`` in a program of its own leaves it be)
    gc.disable()
