"""``import gradpatch.auto`` applies every patch (or those the ``GRADPATCH*`` variables select)."""
from gradpatch.patching.activation import apply

apply()
