"""Router: the mesh's front door (public Generation API)."""
