"""Should I upgrade mlx? One command on the user's own model (issue 48): ``gemmdrift upgrade``.

envs.py (the two releases' interpreters: given, cached, or made with uv and cached by exact versions; every
check before a model loads), worker.py (what runs inside each release's interpreter: logits, greedy tokens, the
decode vs verify:2 envelope, the float32 rung, speed), judge.py (the two releases' runs compared: logits,
where greedy streams part and the verdict there, speed ratio, the class figures), measure.py (the units in
order, checkpointed, and the ``upgrade`` Result).
"""
