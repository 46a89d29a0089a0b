// Package storagee2e is a trimmed e2e.test: Kubernetes' External Storage
// suite and nothing else, so that it builds in minutes from the module proxy
// (upstream's test/e2e links every SIG's tests and all cloud providers).
//
// Build: e2e/k8s/build.sh e2e.test. Run: e2e/storage-suite.
package storagee2e

import (
	"context"
	"flag"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	e2enode "k8s.io/kubernetes/test/e2e/framework/node"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"

	// Define and freeze the feature constants before the specs use them.
	_ "k8s.io/kubernetes/test/e2e/feature"

	// The specs: --storage.testdriver=FILE adds the storage test suites for
	// the driver that FILE defines.
	_ "k8s.io/kubernetes/test/e2e/storage/external"

	// Framework hooks upstream's e2e.test installs: debug dumps on failure,
	// node readiness checks.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/format"

	_ "k8s.io/component-base/logs/testinit"
)

func TestMain(m *testing.M) {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	// The driver definition names its StorageClass file relative to --repo-root.
	if framework.TestContext.RepoRoot != "" {
		testfiles.AddFileSource(testfiles.RootFileSource{Root: framework.TestContext.RepoRoot})
	}
	os.Exit(m.Run())
}

// What upstream's suite set-up does that these specs rely on: every node
// schedulable and the cluster's IP family known.
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "load the kubeconfig")
	framework.ExpectNoError(e2enode.WaitForAllNodesSchedulable(ctx, c, framework.NewTimeoutContext().NodeSchedulable))
	return nil
}, func(ctx context.Context, _ []byte) {
	framework.TestContext.IPFamily = "ipv4"
})

func TestStorage(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	ginkgo.RunSpecs(t, "modelcache-csi external storage", suiteConfig, reporterConfig)
}
