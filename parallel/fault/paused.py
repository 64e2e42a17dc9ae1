"""The first module a supervisor's fork server imports (its preload, :func:`supervisor._context`):
the cyclic garbage collector is paused for the imports that follow (torch's and transformers'
objects, never garbage), until the last one, :mod:`reshard.parallel.fault.frozen`, freezes them
and resumes it. Importing it is the server's whole use of it: nothing else imports it."""

import gc

gc.disable()
