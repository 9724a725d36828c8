#pragma once

// flash_epilogue: the backward-pass dK/dV epilogue of FlashAttention-3 for Hopper, as a
// torch-free CuTe header library. Bump with flash_epilogue/__init__.py's __version__.
#define FLASH_EPILOGUE_VERSION_MAJOR 0
#define FLASH_EPILOGUE_VERSION_MINOR 1
#define FLASH_EPILOGUE_VERSION_PATCH 0
#define FLASH_EPILOGUE_VERSION \
  (FLASH_EPILOGUE_VERSION_MAJOR * 10000 + FLASH_EPILOGUE_VERSION_MINOR * 100 + FLASH_EPILOGUE_VERSION_PATCH)
