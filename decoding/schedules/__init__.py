"""The schedules beyond draft-then-verify in one loop: a draft and a target side run sequentially or in parallel
(PEARL, ``two_sided``), and a drafter that itself runs the loop's speculative step (TriForce, ``triforce``)."""
