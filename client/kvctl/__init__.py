"""kvctl: the operator's command line for kvstored (status, top, ls, get, put, evict,
prefetch, bench...). :mod:`kvctl.cli` parses and runs the commands, :mod:`kvctl.views`
renders what they show. It talks to the daemon only through :mod:`kvclient`."""
