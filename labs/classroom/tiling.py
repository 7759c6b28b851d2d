"""Greedy string tiling (Wise 1993, as JPlag compares programs): the longest common runs of
two token sequences, taken longest first, each token in at most one tile.

    tiles(a, b, min_len, skip_a, skip_b) -> [(i, j, length)]     # a[i:i+length] == b[j:j+length]

A run shorter than min_len is common idiom and never a tile. Tokens marked in skip_a /
skip_b (text both were given, the seams between files) are in no tile. Each round finds
every maximal run among the unmarked tokens through an index of b's min_len-grams, takes
the runs longest first that overlap nothing taken, and marks them; a run cut by a longer
one comes back shorter in the next round, until no run of min_len is left. Repetitive input
(the same line 10,000 times) has a run at every shift: a round's work is bounded (WORK).
"""
MAX_HITS = 64        # places in b one gram of a is matched with: bounds repetitive input
WORK = 32            # token comparisons a round may make, per token of a and b: the same
                     # bound (a round keeps the runs found within it)


def tiles(a, b, min_len, skip_a=None, skip_b=None, index_b=None):
    """index_b: gram_index(b, skip_b, min_len), when b is tiled against many."""
    marked_a = list(skip_a) if skip_a is not None else [False] * len(a)
    marked_b = list(skip_b) if skip_b is not None else [False] * len(b)
    found = []
    while True:
        index = index_b if index_b is not None and not found else gram_index(b, marked_b, min_len)
        runs = _maximal_runs(a, b, min_len, marked_a, marked_b, index)
        taken = 0
        for length, i, j in sorted(runs, key=lambda r: (-r[0], r[1], r[2])):
            if any(marked_a[i:i + length]) or any(marked_b[j:j + length]):
                continue
            marked_a[i:i + length] = [True] * length
            marked_b[j:j + length] = [True] * length
            found.append((i, j, length))
            taken += 1
        if not taken:
            return sorted(found)


def _free_starts(tokens, marked, k):
    """Starts of the k-grams with no marked token."""
    starts, run = [], 0
    for pos, m in enumerate(marked):
        run = 0 if m else run + 1
        if run >= k:
            starts.append(pos - k + 1)
    return starts


def gram_index(b, marked_b, k):
    """{k-gram of b with no marked token: the first MAX_HITS places it starts}."""
    index = {}
    for j in _free_starts(b, marked_b, k):
        hits = index.setdefault(tuple(b[j:j + k]), [])
        if len(hits) < MAX_HITS:
            hits.append(j)
    return index


def _maximal_runs(a, b, k, marked_a, marked_b, index):
    runs, budget = [], WORK * (len(a) + len(b))
    for i in _free_starts(a, marked_a, k):
        for j in index.get(tuple(a[i:i + k]), ()):
            if (i and j and a[i - 1] == b[j - 1] and not marked_a[i - 1] and not marked_b[j - 1]):
                continue                      # not where the run starts
            length = k
            while (i + length < len(a) and j + length < len(b) and a[i + length] == b[j + length]
                   and not marked_a[i + length] and not marked_b[j + length]):
                length += 1
            runs.append((length, i, j))
            budget -= length
            if budget < 0:                    # repetitive input: enough runs for this round
                return runs
    return runs
