"""Functional ops. Layout [B, T, H, dim] for every sequence tensor; every sequence op returns
(out, state), state being None unless output_final_state=True."""
