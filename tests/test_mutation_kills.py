"""Tests that kill the mutants of round 3's code which the other tests let live (scripts/mutation.py; the ids and
the survivors judged equivalent are in docs/guarantees.md, "Mutation testing"). Each test names what it pins; the
comment above it names the mutant ids (``file:line:col:operator``) it kills."""
