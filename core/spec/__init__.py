"""Speculative decoding: a cheap drafter proposes K tokens, the model checks them in one pass.

A round: the drafter guesses d1..dK after the pending token t; the target runs [t, d1..dK] in a
single forward pass, which gives its distribution after each prefix; the longest prefix of
drafts the target agrees with is kept, plus one token of the target's own (the correction at the
first rejection, or a bonus after the last draft). Both KV caches roll back past the first
rejected draft, so each round yields 1..K+1 tokens for one target pass.

Tree rounds: a drafter may propose a tree instead of a chain (Draft.parents): several
continuations sharing prefixes, plus nodes the target only runs for the drafter to look at
(lookahead's window). The target runs the whole tree in one pass with an ancestor mask;
verify_tree walks it from the pending token; the cache keeps the accepted path's K/V in
consecutive slots (ContiguousKV.keep_path). A TreePolicy picks the tree's shape, or a plain step,
by measured tokens per second.

The modules (this package imports none of them: each is imported where it is used):
  drafter.py        the Drafter interface and the Draft a round proposes
  verify.py         greedy and sampled acceptance, for chains (verify) and trees (verify_tree)
  chain_policy.py   KPolicy: a chain drafter's K per round (fixed or auto)
  tree_policy.py    TreePolicy: a tree drafter's option per round, or a plain step
  speculator.py     Speculator: what the decode loop asks each round
  options.py        the one parser of --draft, --draft-k and --lookahead
  build.py          make_speculator: a Speculator from those options
  model_drafter.py  a draft model (another checkpoint, or a quantized copy of the target)
  ngram.py          prompt lookup (--draft ngram)
  lookahead.py      lookahead decoding: a Jacobi window and an n-gram pool as tree drafts
  heads.py          trained draft heads (--draft heads:PATH) as tree drafts; the heads'
                    network (heads_net.py), folder (heads_file.py) and static tree (heads_tree.py)
"""
