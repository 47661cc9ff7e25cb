"""Agreement between ranks on what to run next: the queue callers submit to, the per-cycle
control message, negotiation at rank 0 and its wire format, the response cache, the quorum
decision, autotune and the stall inspector. Decides; moves no tensor bytes."""
