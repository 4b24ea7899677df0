"""Limits of the kvstore.v1 protocol that client and daemon both apply.

ReportReads tells the daemon about gets a client served itself (from slots it knew, or
from the disk file), after the fact. The daemon cannot see those reads, so it bounds
what one report may claim: at most ``MAX_REPORTED_PREFIXES`` prefixes per call and at
most ``MAX_READS_PER_PREFIX`` reads of each. A client sends its report before a
prefix's count reaches the bound, so an honest client never meets it; a report above
it is refused whole (INVALID_ARGUMENT) and counts nothing.
"""

MAX_REPORTED_PREFIXES = 4096
MAX_READS_PER_PREFIX = 1024
