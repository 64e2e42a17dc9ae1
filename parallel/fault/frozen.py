"""The last module a supervisor's fork server imports (its preload, :func:`supervisor._context`):
the cyclic garbage collector skips every object the server imported from here on, in the
server's final collection at exit (about 1 s of CPU per server with torch and transformers
loaded) and in every child forked from it (the imports are never garbage), and runs again after
the preload's imports (:mod:`reshard.parallel.fault.paused`, the first, paused it). Importing it
is the server's whole use of it: nothing else imports it."""

import gc

gc.freeze()
gc.enable()
