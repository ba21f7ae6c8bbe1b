// Prints the kernel library's host-side decisions for shapes read from stdin, so
// tests/test_trt_plugins.py can compare them with trt_plugins/tiling_model.py
// without a GPU (none of these functions touches the device).
// stdin: lines "B T Hq Hkv D S W"; stdout: lines "validate num_splits workspace_size workspace_bound".
#include "tree_attention_kernel.h"

#include <cstdio>

int main()
{
    TreeAttentionParams p{};
    p.dtype = CLOVER_DTYPE_FP16;
    while (std::scanf("%d %d %d %d %d %d %d", &p.batch, &p.num_tokens, &p.num_q_heads, &p.num_kv_heads, &p.head_dim,
               &p.max_seq_len, &p.mask_words)
        == 7)
    {
        std::printf("%d %d %zu %zu\n", treeAttentionValidate(&p), treeAttentionNumSplits(&p),
            treeAttentionWorkspaceSize(&p), treeAttentionWorkspaceBound(p.head_dim));
    }
    return 0;
}
