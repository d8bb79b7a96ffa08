"""The shared room: atomic files, derived seeds, the supported torch range, and the outcomes of a run with their exit codes;
every floor may import it, and it imports nothing of this repository (docs/design.md, "The floors")."""
