"""How a Result reads: its summary and printed text, its figures, and each kind's report section."""
