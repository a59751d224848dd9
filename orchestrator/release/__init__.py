"""What leaves a run directory: ``pick`` (``dpsweep pick``: the deployable trial, pick.toml),
``export`` (``dpsweep export``: a trial's release, read from a verified run directory),
``bundle`` (the release itself: weights, model description, code, loader, privacy statement),
``statement`` (the privacy statement), ``model_card`` (model.json), ``standalone`` (the code a
stranger needs) and ``loader`` (copied into every release as ``load.py``).

Nothing is re-exported: each module's imports (torch among them) are paid only by its users.
"""
