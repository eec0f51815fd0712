"""Editable installs: ship only the startup files (the catalogue is read from the source tree)."""
from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class StartupFilesOnlyWhenEditable(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "editable":
            build_data["force_include_editable"] = {
                "startup/gradpatch.pth": "gradpatch.pth",
                "startup/gradpatch.start": "gradpatch.start",
            }
