"""Counting Pillow's PNG decodes (a header read must not decode)."""


def count_png_decodes(monkeypatch) -> list:
    """The files of the PNG images decoded from now on (each full decode once), while `monkeypatch` holds."""
    from PIL import PngImagePlugin
    decodes, load = [], PngImagePlugin.PngImageFile.load

    def counting(self):
        if getattr(self, "_im", None) is None:
            decodes.append(self.filename)
        return load(self)
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", counting)
    return decodes
