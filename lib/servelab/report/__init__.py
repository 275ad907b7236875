"""Reports: banners, command tables, figures' common setup, HTML rendering and the archive index."""
