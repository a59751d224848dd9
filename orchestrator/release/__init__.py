"""What leaves a run directory: ``pick`` (``dpsweep pick``: the deployable trial, pick.toml),
``export`` (``dpsweep export``: a trial's release, read from a verified run directory) and
``statement`` (the release itself: weights, model description and the privacy statement).

Nothing is re-exported: each module's imports (torch among them) are paid only by its users.
"""
