"""kuangchao_core.ckpt"""
