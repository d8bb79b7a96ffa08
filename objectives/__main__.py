"""`python -m objectives`: the refused combinations the registry holds, as docs/design.md's table rows."""
from objectives.spec import refusal_table

print(refusal_table())
